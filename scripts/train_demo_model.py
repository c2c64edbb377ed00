#!/usr/bin/env python3
"""Train pagedchat's offline demo chat model from scratch on a synthetic corpus.

No model hub is reachable, so pagedchat ships its own tiny LlamaForCausalLM. This script
 1. generates multi-turn ChatML conversations for a few task families (arithmetic on 0..99,
    spelling words backwards, counting letters, capitals of 50 countries, small talk, and
    follow-ups that need the history),
 2. trains a byte-level BPE tokenizer that splits digits into single tokens,
 3. trains the model on assistant tokens only, and
 4. saves everything in Hugging Face format (float16 safetensors).

Fixed operand pairs and words are held out of training; eval_demo_model.py asks about them.
One module per job: pagedchat/demo/corpus.py (facts, phrasings, conversations, the held-out set),
demo_tokenizer.py (BPE + conversation tokenization), demo_training.py (packing, model, loss,
schedule), demo_export.py (Hugging Face files); this script runs them in order.
The run is deterministic for a given --steps and --seed (--minutes picks the step count from
the measured speed, so it is not). Only torch, tokenizers and transformers are needed.

    python scripts/train_demo_model.py --steps 9000 --seed 0 --conversations 150000 \
        --out pagedchat/assets/demo-chat      # the shipped model: about 30 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from pagedchat.demo.corpus import PAD, eval_set, make_conversation, set_word_pieces
from demo_export import save
from demo_tokenizer import Tokenized, train_tokenizer
from demo_training import build_model, lr_at, masked_loss, pack, teacher_forced_accuracy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="pagedchat/assets/demo-chat")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (deterministic)")
    p.add_argument("--minutes", type=float, default=25.0, help="time budget when --steps is not given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=512, help="packed row length; longer chats are dropped")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--conversations", type=int, default=120_000)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in plain fp32")
    args = p.parse_args(argv)

    # Passive OpenMP waits: on shared cores, spinning threads wait on descheduled peers and a
    # 2-thread run can get 5x slower than a 1-thread one. Must be set before torch starts OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)

    tok = train_tokenizer(args.vocab)
    tokd = Tokenized(tok)
    set_word_pieces(tok)
    pad_id = tok.token_to_id(PAD)
    print(f"tokenizer: {tok.get_vocab_size()} tokens", flush=True)

    rng = random.Random(args.seed)
    convs = [make_conversation(rng) for _ in range(args.conversations)]
    x_all, m_all = pack((tokd.conversation(c) for c in convs), args.seq_len, pad_id)
    n_target = int(m_all.sum())
    print(f"corpus: {len(convs)} conversations -> {len(x_all)} rows of {args.seq_len} "
          f"({x_all.numel() / 1e6:.1f}M tokens, {n_target / 1e6:.1f}M assistant targets), "
          f"built in {time.time() - t0:.0f}s", flush=True)
    evals = eval_set(per_family=20)

    model = build_model(tok.get_vocab_size(), args, tokd, pad_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, hidden {args.hidden}, {args.layers} layers", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)

    # Deterministic data order: a seeded permutation of the packed rows, repeated if needed.
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(x_all), generator=g)
    total = args.steps or 10 ** 9
    train_start = time.time()
    seen_tokens, log_loss, log_acc, log_n = 0, 0.0, 0, 0
    step = 0
    while step < total:
        lo = (step * args.batch) % len(order)
        idx = order[lo: lo + args.batch]
        if len(idx) < args.batch:
            idx = torch.cat([idx, order[: args.batch - len(idx)]])
        x, m = x_all[idx], m_all[idx]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        # bf16 autocast roughly doubles CPU matmul speed (avx512_bf16); master weights stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, correct, n = masked_loss(model, x, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen_tokens += x.numel()
        log_loss += loss.item()
        log_acc += correct
        log_n += n
        if step == 50 and args.steps is None:
            # Pick the step count from the measured speed so the run fits the time budget
            # (on shared cores the speed drifts: runs meant to be reproduced use --steps).
            per_step = (time.time() - train_start) / 50
            total = max(100, int((args.minutes * 60 - (time.time() - t0)) / per_step * 0.97) + 20)
            print(f"{per_step:.2f}s/step -> {total} steps for {args.minutes} min", flush=True)
        if step % 25 == 0 or step == total:
            el = time.time() - train_start
            print(f"step {step}/{total} loss {log_loss / 25:.4f} token-acc {log_acc / max(1, log_n):.3f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {seen_tokens / el:.0f} tok/s "
                  f"elapsed {el / 60:.1f} min", flush=True)
            log_loss, log_acc, log_n = 0.0, 0, 0
        if step % args.eval_every == 0 or step == total:
            acc = teacher_forced_accuracy(model, tokd, evals)
            print("  held-out exact match: " + " ".join(f"{k} {v:.2f}" for k, v in acc.items()), flush=True)

    save(model, tok, tokd, Path(args.out), pad_id)
    total_s = time.time() - t0
    print(f"saved to {args.out}; {step} steps, {seen_tokens / 1e6:.1f}M tokens, total time "
          f"{total_s / 60:.1f} min ({total_s:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
