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
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from lerobot_mg.errors import config_error
from lerobot_mg.policies.vla.common import LANGUAGE_ATTENTION_MASK, LANGUAGE_TOKENS
from lerobot_mg.processors.pipeline import ProcessorStep, register_step
from lerobot_mg.processors.tokenizer_source import resolve_tokenizer

TASK_KEY = "task"
STATE_KEY = "observation.state"
# pi0.5's state bins: the left edges of 256 equal bins of [-1, 1] (openpi's PaligemmaTokenizer, LeRobot's step).
STATE_BIN_EDGES = np.linspace(-1, 1, 256 + 1)[:-1]


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

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        state = batch.get(STATE_KEY)
        if not isinstance(state, Tensor):
            raise ValueError(f"{self.registry_name} needs the batch's {STATE_KEY!r}: pi0.5 reads the state in its "
                             "prompt")
        tasks = _tasks(batch, TASK_KEY, self.registry_name)
        # numpy's digitize on the host, as LeRobot's step: a value compares with the float64 edges unrounded.
        bins = np.digitize(state.detach().float().cpu().numpy(), bins=STATE_BIN_EDGES) - 1
        prompts = []
        for task, state_bins in zip(tasks, bins, strict=True):
            text = task.strip().replace("_", " ").replace("\n", " ")
            prompts.append(f"Task: {text}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: ")
        return {**batch, TASK_KEY: prompts}

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

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        encoded = self.tokenizer(_tasks(batch, self.task_key, self.registry_name), max_length=self.max_length,
                                 truncation=self.truncation, padding=self.padding, padding_side=self.padding_side,
                                 return_tensors="pt")
        device = next((value.device for key, value in batch.items()
                       if isinstance(value, Tensor) and key.startswith(("observation.", "action"))), None)
        tokens, mask = encoded["input_ids"], encoded["attention_mask"].to(torch.bool)
        if device is not None:
            tokens, mask = tokens.to(device), mask.to(device)
        return {**batch, LANGUAGE_TOKENS: tokens, LANGUAGE_ATTENTION_MASK: mask}

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
