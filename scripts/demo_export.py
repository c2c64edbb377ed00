"""Saving the trained demo model in Hugging Face format (float16 safetensors, tokenizer files with the
chat template)."""

from __future__ import annotations

import json
from pathlib import Path

from pagedchat.demo.corpus import (CHAT_TEMPLATE, IM_END, IM_START, PAD)

def save(model, tok, tokd, out: Path, pad_id):
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    model.generation_config = GenerationConfig(
        eos_token_id=[tokd.im_end, pad_id], pad_token_id=pad_id, do_sample=False, max_new_tokens=256)
    model.save_pretrained(out, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None, unk_token=None,
        additional_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE,
        model_max_length=model.config.max_position_embeddings, clean_up_tokenization_spaces=False)
    hf_tok.save_pretrained(out)
    # Keep the template inside tokenizer_config.json too, for loaders that only read that file.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    # Class and key names older transformers (4.x) understand too.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {"eos_token": IM_END, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")

