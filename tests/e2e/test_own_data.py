"""Your own data and reward, end to end: a parquet file in verl's schema and a custom reward file;
train a few steps; evaluate a mid-run checkpoint (vLLM and transformers give the same greedy
answers); export it; load the export; the run leaves its generations where a person can read them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    """Length up to 40 characters, so a random model's groups differ; 1.0 for the right answer."""
    return 1.0 if str(ground_truth) in solution_str else min(len(solution_str), 40) / 40
'''


def write_parquet(path: Path, n: int, split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "my_math" if i % 2 else "my_facts",
            "prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}? Put the answer in \\\\boxed{{}}."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def assert_own_reward(rows: list[dict]) -> None:
    """Each generation row's score is the custom reward's (a fraction for a wrong answer of under
    40 characters), not the math verifier's 0/1."""
    scope: dict = {}
    exec(REWARD, scope)
    for r in rows:
        assert r["score"] == pytest.approx(scope["score"](r["data_source"], r["response"], r["ground_truth"])), r


def one(paths) -> Path:
    found = list(paths)
    assert len(found) == 1, found
    return found[0]


def main(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    return p


def test_own_parquet_and_reward_train_eval_export(tmp_path):
    train, val, reward = tmp_path / "train.parquet", tmp_path / "val.parquet", tmp_path / "my_reward.py"
    write_parquet(train, 64, "train")
    write_parquet(val, 8, "test")
    reward.write_text(REWARD)
    fn = f"reward.functions=[{{name: custom, path: {reward}, function: score}}]"
    common = [fn, f"data.val_files=[{val}]", "rollout.max_response_length=16", "rollout.dtype=float32", "logger.progress_bar=false"]
    run = tmp_path / "run"
    main("hybrid_rl.main", "+recipe=grpo_math", "model.path=builtin:tiny", "trainer.nproc_per_node=1", f"data.train_files=[{train}]",
         *common, "data.train_batch_size=4", "rollout.n=4", "actor.micro_batch_size=16", "trainer.total_steps=2", "trainer.val_every=2",
         "trainer.save_every=1", "trainer.keep_last=2", "logger.generations=3", "logger.generations_every=1", f"trainer.output_dir={run}")  # fmt: skip
    # generations a person can read: validation before training and at step 2, training at steps 1 and 2
    gens = sorted(p.name for p in (run / "generations").iterdir())
    assert gens == ["train_step_0001.jsonl", "train_step_0002.jsonl", "val_step_0000.jsonl", "val_step_0002.jsonl"]
    row = json.loads((run / "generations" / "val_step_0002.jsonl").read_text().splitlines()[0])
    assert set(row) == {"prompt", "response", "score", "ground_truth", "data_source"} and "plus" in row["prompt"]
    # validation scored with the run's own reward (not the math verifier), as eval does below
    for name in ("val_step_0000.jsonl", "val_step_0002.jsonl"):
        assert_own_reward([json.loads(x) for x in (run / "generations" / name).read_text().splitlines()])
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"val/accuracy/my_math", "val/accuracy/my_facts"} <= set(metrics[-1])

    # evaluate the mid-run checkpoint with both rollout backends: vLLM with nothing but the
    # checkpoint (the run's val file, lengths and reward come from its recorded config, into a
    # folder of its own), transformers with everything given
    ckpt = run / "checkpoints" / "step_000001"
    evals = {}
    for backend in ("vllm", "hf"):
        given = [*common, f"trainer.output_dir={tmp_path / 'eval_hf'}"] if backend == "hf" else ["logger.progress_bar=false", "rollout.dtype=float32"]
        main("hybrid_rl.main", "+recipe=eval_math", f"model.path={ckpt}", "rollout.val_pass_k=2", f"rollout.backend={backend}",
             *given, cwd=tmp_path)  # fmt: skip
        out = tmp_path / "eval_hf" if backend == "hf" else one(tmp_path.glob("outputs/eval_math/run-step_000001-*"))
        summary = json.loads((out / "eval.json").read_text())
        assert summary["n"] == 8 and {"val/accuracy_se", "val/pass@2_se", "val/accuracy/my_math"} <= set(summary["metrics"])
        evals[backend] = [json.loads(x) for x in (out / "generations" / "eval.jsonl").read_text().splitlines()]
        assert_own_reward(evals[backend])
    assert len(evals["vllm"]) == 8
    assert [r["response"] for r in evals["vllm"]] == [r["response"] for r in evals["hf"]]

    # export the checkpoint in bf16; it loads in transformers with the checkpoint's weights
    import torch
    from transformers import AutoModelForCausalLM

    p = main("hybrid_rl.export", str(ckpt), str(tmp_path / "export"), "--dtype", "bfloat16")
    assert json.loads(p.stdout.splitlines()[-1])["step"] == 1
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.bfloat16)
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "eval_hf" / "model", dtype=torch.float32)  # the eval's fp32 export
    for (name, a), (_, b) in zip(exported.state_dict().items(), fp32.state_dict().items(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16)), name
    assert (run / "hf" / "model.safetensors.index.json").is_file()  # the end-of-run export took the same path
