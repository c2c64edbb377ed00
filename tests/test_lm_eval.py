"""lm-eval's `local-completions` against `pagedchat serve` equals lm-eval's own `hf` backend on the same model
and task: every choice's log-likelihood within 1e-4, the same accuracy. The multiple-choice task and its
dataset are local files written here (no hub)."""

import json
import textwrap

import pytest

from serve_util import serving_model

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("the quick brown", ["fox", "dog", "cat", "pool"], 0),
    ("hello world, how are", ["you", "we", "they"], 0),
    ("what is 17 + 25? it is", ["42", "17", "25", "7"], 0),
    ("paged attention keeps every branch in one", ["pool", "tree", "fox"], 0),
    ("a b c d e f", ["g", "h", "z", "0 1 2"], 0),
    ("jumps over the lazy", ["dog", "fox", "brown dog"], 1),
]


def write_task(folder) -> str:
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "pagedchat_mc.yaml").write_text(textwrap.dedent(f"""\
        task: pagedchat_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        target_delimiter: " "
        metric_list:
          - metric: acc
        """))
    return "pagedchat_mc"


def evaluate(model: str, model_args: str, task: str, folder) -> tuple[float, list[list[float]]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                              task_manager=TaskManager(include_path=str(folder)), batch_size=4)
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    lls = [[resp[0][0] for resp in s["resps"]] for s in samples]
    return results["results"][task]["acc,none"], lls


def test_local_completions_equals_hf_backend(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    path = model_dirs["llama"][0]
    task = write_task(tmp_path)
    hf_acc, hf_lls = evaluate("hf", f"pretrained={path},dtype=float32,device=cpu", task, tmp_path)
    with serving_model(path, "tiny") as (url, _):
        args = (f"model=tiny,base_url={url}/completions,tokenizer={path},tokenizer_backend=huggingface,"
                f"num_concurrent=1,max_retries=1")
        acc, lls = evaluate("local-completions", args, task, tmp_path)
    assert [len(c) for c in lls] == [len(c) for _, c, _ in QUESTIONS]
    for ours, theirs in zip(lls, hf_lls):
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert acc == hf_acc
