"""Training helpers for the demo model: packing rows, the model, the masked loss, held-out
teacher-forced accuracy, the learning-rate schedule."""

from __future__ import annotations

import math

from demo_tokenizer import Tokenized

# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def pack(examples, seq_len: int, pad_id: int):
    """Greedy packing of whole conversations into rows of seq_len (deterministic, in order)."""
    import torch

    rows, masks = [], []
    cur, cur_m = [], []
    for ids, m in examples:
        if len(ids) > seq_len:
            continue
        if len(cur) + len(ids) > seq_len:
            rows.append(cur + [pad_id] * (seq_len - len(cur)))
            masks.append(cur_m + [0] * (seq_len - len(cur_m)))
            cur, cur_m = [], []
        cur += ids
        cur_m += m
    if cur:
        rows.append(cur + [pad_id] * (seq_len - len(cur)))
        masks.append(cur_m + [0] * (seq_len - len(cur_m)))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool)


def build_model(vocab_size, args, tokd: Tokenized, pad_id):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        # The context it was trained on: a longer chat gets pagedchat's 'context is full' message
        # instead of garbage from positions it never saw.
        max_position_embeddings=args.seq_len, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokd.im_end, pad_token_id=pad_id, initializer_range=0.02,
        attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def masked_loss(model, x, m):
    """Next-token loss on the assistant tokens only; returns (loss, n_correct, n_targets)."""
    import torch
    import torch.nn.functional as F

    logits = model(input_ids=x).logits[:, :-1]
    targets = x[:, 1:].masked_fill(~m[:, 1:], -100)  # -100: no loss on prompt and padding
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100)
    with torch.no_grad():
        sel = targets != -100
        correct = (logits.argmax(-1)[sel] == targets[sel]).sum().item()
        targets = targets[sel]
    return loss, correct, targets.numel()


def last_answer_only(mask: list[int]) -> list[int]:
    """Keep only the final run of target tokens (the last assistant answer)."""
    end = max(i for i, v in enumerate(mask) if v)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [0] * start + mask[start:]


def teacher_forced_accuracy(model, tokd, evals):
    """Fraction of held-out answers whose every token is the argmax: equals greedy exact match."""
    import torch

    model.eval()
    hits: dict[str, list[int]] = {}
    with torch.no_grad():
        for fam, conv in evals:
            ids, m = tokd.conversation(conv)
            # Judge only the last answer; earlier answers are history.
            m = last_answer_only(m)
            x = torch.tensor([ids])
            mask = torch.tensor([m], dtype=torch.bool)[:, 1:]
            logits = model(input_ids=x).logits[:, :-1]
            ok = bool((logits.argmax(-1) == x[:, 1:])[mask].all())
            hits.setdefault(fam, []).append(int(ok))
    model.train()
    return {f: sum(v) / len(v) for f, v in hits.items()}


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

