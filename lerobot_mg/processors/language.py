"""The language steps of LeRobot 0.6.1's pi0, pi0.5 and SmolVLA preprocessors, under LeRobot's names.

The task instruction of each frame is the batch's ``task`` (a string per sample, from the dataset's tasks table; a
single sample's string is made a list of one by ``to_batch_processor``). The steps turn it into the prompt and then
into the tokens the policy reads:

- ``pi0_new_line_processor`` / ``smolvla_new_line_processor``: end each task with a newline (what PaliGemma's
  prompt format expects; SmolVLA keeps LeRobot's step too).
- ``pi05_prepare_state_tokenizer_processor_step`` (pi0.5, after the normaliser): the state goes into the prompt,
  each normalised dimension cut into 256 bins of [-1, 1] (``-1`` below, ``255`` at or above the top edge):
  ``"Task: <task>, State: <bins>;\\nAction: "``.
- ``tokenizer_processor``: the prompt through the VLM's tokenizer (transformers' ``AutoTokenizer``), padded to
  ``max_length`` (pi0, pi0.5) or to the longest prompt of the batch (SmolVLA's ``pad_language_to="longest"``), cut at
  ``max_length``: ``observation.language.tokens`` (int64) and ``observation.language.attention_mask`` (bool).

In training the DataLoader's workers do the host's part (:func:`worker_language`, the collate's last step), so that
the step itself never waits for the device: pi0's and SmolVLA's prompts arrive tokenised, as CPU tensors the loop
copies to the device with the rest of the batch; pi0.5's prompt arrives as the tokens of its head (``"Task: <task>,
State:"``), its state is cut into bins on the device (``torch.bucketize``) and the tokens of each bin (a table made
once from the tokenizer) join the head there. That gives the tokenizer's tokens of the whole prompt when the
tokenizer splits the prompt at those seams; :class:`TokenizerStep` checks it on every bin when the table is made,
and otherwise tokenises pi0.5's prompts on the host, as inference does.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from lerobot_mg.errors import config_error
from lerobot_mg.policies.vla.common import LANGUAGE_ATTENTION_MASK, LANGUAGE_TOKENS
from lerobot_mg.processors.pipeline import ProcessorStep, register_step
from lerobot_mg.processors.tokenizer_source import resolve_tokenizer

TASK_KEY = "task"
STATE_KEY = "observation.state"
# pi0.5's state bins: the left edges of 256 equal bins of [-1, 1] (openpi's PaligemmaTokenizer, LeRobot's step).
STATE_BIN_EDGES = np.linspace(-1, 1, 256 + 1)[:-1]
STATE_BIN_VALUES = range(-1, 256)  # what np.digitize(...) - 1 gives on those edges
# The batch keys of pi0.5's prompt made in the DataLoader's workers and finished on the device (see the module
# docstring): the head's tokens (B, H) int64 right-padded, each head's length (B,), the state's bins (B, D).
PROMPT_HEAD_TOKENS = "observation.language.prompt_head_tokens"
PROMPT_HEAD_LENGTH = "observation.language.prompt_head_length"
STATE_BINS = "observation.language.state_bins"


def _pi05_text(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def _pi05_head(task: str) -> str:
    return f"Task: {_pi05_text(task)}, State:"


def _tasks(batch: dict[str, Any], task_key: str, step: str) -> list[str]:
    task = batch.get(task_key)
    if isinstance(task, str):
        return [task]
    if isinstance(task, (list, tuple)) and all(isinstance(item, str) for item in task):
        return list(task)
    raise ValueError(f"{step} needs the batch's {task_key!r} (a string per sample: the frame's task instruction), "
                     f"and the batch holds {type(task).__name__ if task is not None else 'none'}")


class _NewLineStep(ProcessorStep):
    """Ends each task string with a newline (one already there is kept)."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        task = batch.get(TASK_KEY)
        if isinstance(task, str):
            return {**batch, TASK_KEY: task if task.endswith("\n") else f"{task}\n"}
        if isinstance(task, list) and all(isinstance(item, str) for item in task):
            return {**batch, TASK_KEY: [item if item.endswith("\n") else f"{item}\n" for item in task]}
        return batch

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> _NewLineStep:
        return cls()


@register_step
class Pi0NewLineStep(_NewLineStep):
    registry_name: ClassVar[str] = "pi0_new_line_processor"


@register_step
class SmolVLANewLineStep(_NewLineStep):
    registry_name: ClassVar[str] = "smolvla_new_line_processor"


@register_step
class Pi05StatePromptStep(ProcessorStep):
    """pi0.5's prompt: the task and the normalised state cut into 256 bins (see the module docstring). Runs after the
    normaliser, whose QUANTILES mode puts the bulk of each state dimension in [-1, 1]."""

    registry_name: ClassVar[str] = "pi05_prepare_state_tokenizer_processor_step"

    def __init__(self) -> None:
        self.edges = torch.from_numpy(STATE_BIN_EDGES)  # float64; float32 on MPS, which has no float64

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        state = batch.get(STATE_KEY)
        if not isinstance(state, Tensor):
            raise ValueError(f"{self.registry_name} needs the batch's {STATE_KEY!r}: pi0.5 reads the state in its "
                             "prompt")
        if PROMPT_HEAD_TOKENS in batch:  # the workers made the head: the bins stay on the device
            return {**batch, STATE_BINS: self.bins(state)}
        tasks = _tasks(batch, TASK_KEY, self.registry_name)
        # numpy's digitize on the host, as LeRobot's step: a value compares with the float64 edges unrounded.
        bins = np.digitize(state.detach().float().cpu().numpy(), bins=STATE_BIN_EDGES) - 1
        prompts = []
        for task, state_bins in zip(tasks, bins, strict=True):
            prompts.append(f"Task: {_pi05_text(task)}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: ")
        return {**batch, TASK_KEY: prompts}

    def bins(self, state: Tensor) -> Tensor:
        """(B, D) int64 bins of the state on its device: numpy's ``digitize(x, edges) - 1`` (``bins[i-1] <= x <
        bins[i]``), each float32 value compared with the float64 edges unrounded, as on the host."""
        dtype = torch.float32 if state.device.type == "mps" else torch.float64
        if self.edges.device != state.device or self.edges.dtype != dtype:
            self.edges = self.edges.to(device=state.device, dtype=dtype)  # once: to() moves them with the pipeline
        return torch.bucketize(state.detach().float().to(dtype), self.edges, right=True) - 1

    def to(self, device: torch.device | str) -> Pi05StatePromptStep:
        device = torch.device(device)
        self.edges = self.edges.to(device=device, dtype=torch.float32 if device.type == "mps" else torch.float64)
        return self

    def get_config(self) -> dict[str, Any]:
        return {}  # LeRobot saves none (its max_state_dim and task_key keep their defaults when it loads the step)

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> Pi05StatePromptStep:
        return cls()


@register_step
class TokenizerStep(ProcessorStep):
    """The batch's prompts through the tokenizer ``tokenizer_name`` (a directory, or a Hub repo id found through
    huggingface_hub's cache: :mod:`lerobot_mg.processors.tokenizer_source`). The tokens land on the device of the
    batch's observations; ``tokenizer_name`` is saved as given."""

    registry_name: ClassVar[str] = "tokenizer_processor"

    def __init__(self, tokenizer_name: str, max_length: int = 512, task_key: str = TASK_KEY,
                 padding_side: str = "right", padding: str = "max_length", truncation: bool = True,
                 source_key: str = "tokenizer_processor.tokenizer_name") -> None:
        self.tokenizer_name = tokenizer_name
        self.max_length = int(max_length)
        self.task_key = task_key
        self.padding_side = padding_side
        self.padding = padding
        self.truncation = bool(truncation)
        directory = resolve_tokenizer(tokenizer_name, source_key)
        # transformers is imported by the runs that tokenise only (its import costs every process about a second).
        auto_tokenizer = importlib.import_module("transformers").AutoTokenizer
        self.tokenizer = auto_tokenizer.from_pretrained(str(directory), local_files_only=True)
        self.device = torch.device("cpu")
        self._bin_tables: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if LANGUAGE_TOKENS in batch and LANGUAGE_ATTENTION_MASK in batch:  # tokenised in the DataLoader's workers
            return batch
        if PROMPT_HEAD_TOKENS in batch and STATE_BINS in batch:  # pi0.5's prompt finished on the device
            head, head_length = batch[PROMPT_HEAD_TOKENS], batch[PROMPT_HEAD_LENGTH]
            tokens, mask = self.state_prompt_tokens(head, head_length, batch[STATE_BINS])
            rest = {k: v for k, v in batch.items() if k not in (PROMPT_HEAD_TOKENS, PROMPT_HEAD_LENGTH, STATE_BINS)}
            return {**rest, LANGUAGE_TOKENS: tokens, LANGUAGE_ATTENTION_MASK: mask}
        encoded = self.tokenizer(_tasks(batch, self.task_key, self.registry_name), max_length=self.max_length,
                                 truncation=self.truncation, padding=self.padding, padding_side=self.padding_side,
                                 return_tensors="pt")
        device = next((value.device for key, value in batch.items()
                       if isinstance(value, Tensor) and key.startswith(("observation.", "action"))), None)
        tokens, mask = encoded["input_ids"], encoded["attention_mask"].to(torch.bool)
        if device is not None:
            tokens, mask = tokens.to(device), mask.to(device)
        return {**batch, LANGUAGE_TOKENS: tokens, LANGUAGE_ATTENTION_MASK: mask}

    def to(self, device: torch.device | str) -> TokenizerStep:
        self.device = torch.device(device)
        if self._bin_tables is not None:
            self._bin_tables = tuple(table.to(self.device) for table in self._bin_tables)
        return self

    def state_prompts_on_device(self) -> bool:
        """Whether pi0.5's prompts can be finished on the device: padded to ``max_length`` on the right, and the
        tokenizer's tokens of every prompt are those of its head, of each bin (``" <bin>"``) and of the last bin
        with the tail (``" <bin>;\\nAction: "``) one after the other, checked on every bin value at every place.
        Makes the tables of the bins' tokens on first call (on the step's device)."""
        if (self.padding != "max_length" or self.padding_side != "right" or not self.truncation
                or self.task_key != TASK_KEY):
            return False
        if self._bin_tables is None:
            tables = self._make_bin_tables()
            if tables is None:
                return False
            self._bin_tables = tuple(table.to(self.device) for table in tables)
        return True

    def _make_bin_tables(self) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        tokenizer, values = self.tokenizer, list(STATE_BIN_VALUES)
        middle = tokenizer([f" {v}" for v in values], add_special_tokens=False)["input_ids"]
        last = tokenizer([f" {v};\nAction: " for v in values], add_special_tokens=False)["input_ids"]
        heads = [_pi05_head(task) for task in ("pick up the cube", "x", "Put the_cube back\n")]
        head_ids = tokenizer(heads)["input_ids"]
        count = len(values)
        prompts, expected = [], []
        for h, head in enumerate(heads):
            for i, v in enumerate(values):  # each value first, in the middle and last, beside varied neighbours
                u, w = values[(7 * i + 3 + h) % count], values[(13 * i + 5 + h) % count]
                prompts.append(f"{head} {v} {u} {w};\nAction: ")
                expected.append(head_ids[h] + middle[i] + middle[(7 * i + 3 + h) % count]
                                + last[(13 * i + 5 + h) % count])
            prompts.append(f"{head} {values[h]};\nAction: ")  # a state of one dimension
            expected.append(head_ids[h] + last[h])
        if tokenizer(prompts)["input_ids"] != expected or tokenizer.pad_token_id is None:
            return None

        def table(ids: list[list[int]]) -> tuple[Tensor, Tensor]:
            width = max(len(row) for row in ids)
            return (torch.tensor([row + [0] * (width - len(row)) for row in ids], dtype=torch.int64),
                    torch.tensor([len(row) for row in ids], dtype=torch.int64))

        return (*table(middle), *table(last))

    def prompt_heads(self, tasks: list[str]) -> tuple[Tensor, Tensor]:
        """(B, H) int64 tokens of pi0.5's prompt heads (``"Task: <task>, State:"``, with the tokenizer's special
        tokens; right-padded with 0) and their lengths (B,), on the host: the DataLoader workers' part."""
        ids = self.tokenizer([_pi05_head(task) for task in tasks])["input_ids"]
        width = max(len(row) for row in ids)
        return (torch.tensor([row + [0] * (width - len(row)) for row in ids], dtype=torch.int64),
                torch.tensor([len(row) for row in ids], dtype=torch.int64))

    def state_prompt_tokens(self, head: Tensor, head_length: Tensor, bins: Tensor) -> tuple[Tensor, Tensor]:
        """pi0.5's tokens (B, max_length) and attention mask from the heads' tokens and the state's bins (B, D), on
        their device with torch ops only: the head, each bin's tokens, the last bin's with the tail, then the
        tokenizer's padding, cut at ``max_length``. Needs :meth:`state_prompts_on_device`."""
        if not self.state_prompts_on_device():
            raise RuntimeError("this tokenizer's pi0.5 prompts cannot be finished on the device")
        assert self._bin_tables is not None
        middle, middle_length, last, last_length = (t.to(bins.device) for t in self._bin_tables)
        rows = bins + 1  # the tables' row of each bin value (-1 is row 0)
        width = max(head.shape[1], middle.shape[1], last.shape[1])
        pieces = torch.cat([F.pad(head, (0, width - head.shape[1]))[:, None],
                            F.pad(middle, (0, width - middle.shape[1]))[rows[:, :-1]],
                            F.pad(last, (0, width - last.shape[1]))[rows[:, -1:]]], dim=1)  # (B, 1 + D, width)
        lengths = torch.cat([head_length[:, None], middle_length[rows[:, :-1]], last_length[rows[:, -1:]]], dim=1)
        ends = torch.cumsum(lengths, dim=1)
        position = torch.arange(self.max_length, device=bins.device).expand(bins.shape[0], -1).contiguous()
        piece = torch.searchsorted(ends, position, right=True).clamp_(max=lengths.shape[1] - 1)
        offset = (position - (ends - lengths).gather(1, piece)).clamp_(0, width - 1)
        tokens = pieces.flatten(1).gather(1, piece * width + offset)
        mask = position < ends[:, -1:]
        return tokens.masked_fill(~mask, self.tokenizer.pad_token_id), mask

    def get_config(self) -> dict[str, Any]:
        return {"max_length": self.max_length, "task_key": self.task_key, "padding_side": self.padding_side,
                "padding": self.padding, "truncation": self.truncation, "tokenizer_name": self.tokenizer_name}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> TokenizerStep:
        if not config.get("tokenizer_name"):  # LeRobot saves none for a step it was handed a tokenizer object
            raise config_error(f"{cls.registry_name}.config.tokenizer_name", None, "is not saved, so the tokenizer "
                               "the policy was trained with is unknown", f"add \"tokenizer_name\": \"<its directory "
                               f"or Hub repo id>\" to the {cls.registry_name} step's config in "
                               "policy_preprocessor.json")
        return cls(config["tokenizer_name"], config.get("max_length", 512), config.get("task_key", TASK_KEY),
                   config.get("padding_side", "right"), config.get("padding", "max_length"),
                   config.get("truncation", True))


class WorkerLanguage:
    """The host's part of a VLA preprocessor's language steps, run by the DataLoader's workers on each collated batch
    (see the module docstring); picklable."""

    def __init__(self, steps: list[ProcessorStep], tokenizer: TokenizerStep, state_prompt: bool) -> None:
        self.steps, self.tokenizer, self.state_prompt = steps, tokenizer, state_prompt

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        for step in self.steps:
            batch = step(batch)
        if self.state_prompt:
            head, length = self.tokenizer.prompt_heads(_tasks(batch, TASK_KEY, "pi0.5's prompt"))
            return {**batch, PROMPT_HEAD_TOKENS: head, PROMPT_HEAD_LENGTH: length}
        return self.tokenizer(batch)


def worker_language(preprocessor: Any) -> WorkerLanguage | None:
    """What the DataLoader's workers do of ``preprocessor``'s language steps (None: nothing, for a policy without
    a tokenizer step, or pi0.5 with a tokenizer whose prompts cannot be finished on the device)."""
    tokenizers = [step for step in preprocessor.steps if isinstance(step, TokenizerStep)]
    if len(tokenizers) != 1:
        return None
    tokenizer = tokenizers[0]
    before = preprocessor.steps[:preprocessor.steps.index(tokenizer)]
    if any(isinstance(step, Pi05StatePromptStep) for step in before):
        return WorkerLanguage([], tokenizer, True) if tokenizer.state_prompts_on_device() else None
    return WorkerLanguage([step for step in before if isinstance(step, _NewLineStep)], tokenizer, False)
