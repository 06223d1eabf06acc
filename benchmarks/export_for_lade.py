"""Export the embedded model and benchmark prompts for lade (runs in forerun's own environment).

lade 0.0.2 runs with transformers 4.34, which cannot read GGUF files nor every field of a transformers-5 config, so
the weights are written as safetensors with an explicit llama config in 4.34's field names, and the prompts as
token ids (chat template already applied, so both sides feed exactly the same ids). The reference continuation of
plain greedy `model.generate` (transformers 5) is stored with each prompt to check lade's output token for token.

Usage (from the repository root):
    .venv/bin/python benchmarks/export_for_lade.py --dataset gsm8k,humaneval --n 5 --max-new-tokens 128 --out X
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from forerun.bench.datasets import load_dataset
from forerun.models import load_model


def llama_config_for_434(config) -> dict:
    """The fields transformers 4.34's LlamaConfig reads, taken from a transformers-5 config."""
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "attention_bias": getattr(config, "attention_bias", False),
        "torch_dtype": "float32",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default="gsm8k,humaneval")
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    if model.config.model_type != "llama":
        raise SystemExit(f"lade 0.0.2 supports llama models only; {args.model} is {model.config.model_type}")
    folder = args.out / "model"
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(llama_config_for_434(model.config), indent=1))
    prompts = []
    for name in args.dataset.split(","):
        for prompt in load_dataset(name.strip(), args.n):
            ids = tokenizer.apply_chat_template(
                list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            reference = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            prompts.append(
                {
                    "prompt_id": prompt.id,
                    "dataset": prompt.dataset,
                    "input_ids": ids[0].tolist(),
                    "reference_ids": reference[0].tolist(),
                }
            )
    settings = {"model": args.model, "max_new_tokens": args.max_new_tokens, "eos_token_id": tokenizer.eos_token_id}
    (args.out / "prompts.json").write_text(json.dumps({"settings": settings, "prompts": prompts}))
    print(f"exported {folder} and {len(prompts)} prompts to {args.out / 'prompts.json'}")


if __name__ == "__main__":
    main()
