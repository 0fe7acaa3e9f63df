"""Write the tiny tokenizers (and the tiny SmolVLM's config) that the CPU presets experiment=aloha_pi0_tiny,
aloha_pi05_tiny and aloha_smolvla_tiny read, into lerobot_mg/data/vla_tiny/{paligemma,smolvlm} (package data), or
with --out DIR elsewhere (tests/unit/test_vla_presets.py compares the two).

The real tokenizers (PaliGemma's 257,152 tokens, SmolVLM2's 49,280) would need the Hub and embedding tables larger
than the tiny models themselves. These are trained here with the `tokenizers` library on a fixed corpus (the ALOHA
transfer-cube instruction, a few other manipulation tasks, every printable ASCII character, pi0.5's prompt form
with the state bins -1..255), so any ASCII instruction tokenises without an unknown token; the same call writes the
same files. The structure is that of the real ones:

- ``paligemma/``: SentencePiece-style BPE (a "▁" marks each space, no space prepended), Gemma's special ids
  ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<bos>`` prepended to every prompt; 300 tokens.
- ``smolvlm/``: byte-level BPE as SmolLM2's, ``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2 (padding),
  SmolVLM's image tokens after the trained ones, nothing added around a prompt; 404 tokens. ``config.json`` is the
  tiny SmolVLM (a transformers ``SmolVLMConfig``) that ``policy.vlm_model_name`` names.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, SmolVLMConfig

OUT = Path(__file__).resolve().parents[1] / "lerobot_mg" / "data" / "vla_tiny"
# The embedded dataset's instruction (lerobot_mg.sim.generate.TASK) first, then other tabletop tasks so that
# merges are not all fitted to one sentence.
TASKS = (
    "Pick up the cube with the right arm and transfer it to the left arm.",
    "pick up the red cube", "place the blue block in the bowl and then close the drawer slowly",
    "open the drawer", "stack the green cup on the plate", "push the yellow button twice",
    "put the bowl on the stove", "turn on the stove", "put both the alphabet soup and the tomato sauce in the basket",
)
PALIGEMMA_VOCAB = 300
SMOLVLM_TRAINED_VOCAB = 400
SMOLVLM_IMAGE_TOKENS = ("<global-img>", "<fake_token_around_image>", "<image>", "<end_of_utterance>")
# The tiny SmolVLM: 6 language layers of width 64 (4 heads of 16, 2 key/value heads), a one-layer vision encoder
# of width 32 on 32x32 images in 4x4 patches, pixel shuffle 2 (16 image tokens).
SMOLVLM_TEXT = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}
SMOLVLM_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 32, "patch_size": 4}


def corpus() -> list[str]:
    lines = [string.printable.strip()]
    for task in TASKS:
        lines += [task, f"{task}\n", f"Task: {task.lower().rstrip('.')}, State: 0 1 2 3;\nAction: "]
    lines += [" ".join(str(i) for i in range(start, min(start + 16, 256))) for start in range(0, 256, 16)]
    lines.append("-1 255 128 64 32 16 8 4 2 1 0")
    return lines


def write_paligemma_like(out_dir: Path) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(
        vocab_size=PALIGEMMA_VOCAB, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"], show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                             special_tokens=[("<bos>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(str(out_dir))


def write_smolvlm_like(out_dir: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(
        vocab_size=SMOLVLM_TRAINED_VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in SMOLVLM_IMAGE_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>",
        extra_special_tokens={"global_image_token": "<global-img>", "fake_image_token": "<fake_token_around_image>",
                              "image_token": "<image>", "end_of_utterance_token": "<end_of_utterance>"})
    fast.save_pretrained(str(out_dir))
    pad_id = tokenizer.token_to_id("<|im_end|>")
    text = {"model_type": "llama", **SMOLVLM_TEXT, "vocab_size": len(fast), "tie_word_embeddings": False,
            "bos_token_id": tokenizer.token_to_id("<|im_start|>"), "eos_token_id": pad_id, "pad_token_id": pad_id}
    config = SmolVLMConfig(text_config=text, vision_config={"model_type": "smolvlm_vision", **SMOLVLM_VISION},
                           scale_factor=2, image_token_id=tokenizer.token_to_id("<image>"), pad_token_id=pad_id,
                           tie_word_embeddings=False)
    # Written without transformers' version stamp, so that the files depend on this script alone.
    values = {key: value for key, value in config.to_diff_dict().items() if key != "transformers_version"}
    (out_dir / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def write_assets(out: Path) -> None:
    write_paligemma_like(out / "paligemma")
    write_smolvlm_like(out / "smolvlm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT})")
    write_assets(parser.parse_args().out)


if __name__ == "__main__":
    main()
