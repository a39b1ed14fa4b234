"""The synthetic task and the prompt loader (including its error messages)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybrid_rl.data import synth_math
from hybrid_rl.data.dataset import DataError, PromptSampler, load_prompts, read_rows
from hybrid_rl.rewards.functions import math_reward

pytestmark = pytest.mark.unit


class Cfg:
    prompt_key = "prompt"
    answer_key = "reward_model.ground_truth"
    max_prompt_length = 128
    truncation = "skip"
    system_prompt = None


def test_problems_are_correct_and_levels_scale():
    import random

    rng = random.Random(0)
    for level in synth_math.LEVELS:
        for _ in range(50):
            p = synth_math.make_problem(rng, level)
            assert p.level == level
            # the worked solution's last equation gives the answer, and the verifier agrees
            assert p.solution.rstrip(".").split("= ")[-1] == str(p.answer)
            assert math_reward("x", synth_math.format_solution(p), str(p.answer)) == 1.0
    with pytest.raises(ValueError, match="level"):
        synth_math.make_problem(rng, 9)


def test_splits_fixed_by_seed_and_disjoint(tmp_path):
    a = synth_math.write_splits(tmp_path / "a", 300, 50, seed=1, levels=[1, 2, 3, 4], n_val_seen=20)
    b = synth_math.write_splits(tmp_path / "b", 300, 50, seed=1, levels=[1, 2, 3, 4], n_val_seen=20)
    ra, rb = read_rows(a["train"]), read_rows(b["train"])
    assert ra == rb and len(ra) == 300
    assert read_rows(a["val_seen"]) == read_rows(b["val_seen"])
    texts = {split: {r["prompt"][0]["content"] for r in read_rows(a[split])} for split in ("train", "val", "val_seen")}
    assert not texts["val"] & texts["train"] and not texts["val_seen"] & texts["train"]
    row = ra[0]
    assert row["data_source"] == synth_math.DATA_SOURCE
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["style"] == "rule"
    assert row["extra_info"]["split"] == "train"


def _worked_facts(row: dict) -> set[str]:
    """The equations a row's worked solution (what SFT imitates) states, read from its text."""
    return set(row["extra_info"]["solution"].split(" The answer")[0].rstrip(".").split(". "))


def test_held_out_problems_share_no_worked_fact_with_training():
    """The default splits: every held-out problem states an equation that no training row's worked
    solution states in either order (the SFT target, the RL prompts and the preference pairs all come from the
    train split), at every level; every in-distribution problem's equations are all in training,
    and its question is new. A split by question text alone fails the first check (61% of the
    held-out problems had a training twin)."""
    splits = synth_math.make_splits(20000, 1024, 256, seed=0, levels=[1, 2, 3, 4])
    trained = {synth_math.fact_key(f) for r in splits["train"] for f in _worked_facts(r)}
    questions = {r["prompt"][0]["content"] for r in splits["train"]}
    by_level: dict[int, int] = {}
    for r in splits["val"]:
        assert not {synth_math.fact_key(f) for f in _worked_facts(r)} <= trained, r["extra_info"]["solution"]
        assert r["data_source"] == synth_math.HELDOUT_SOURCE
        by_level[r["extra_info"]["level"]] = by_level.get(r["extra_info"]["level"], 0) + 1
    assert by_level == {1: 256, 2: 256, 3: 256, 4: 256}
    for r in splits["val_seen"]:
        assert {synth_math.fact_key(f) for f in _worked_facts(r)} <= trained and r["prompt"][0]["content"] not in questions
        assert r["data_source"] == synth_math.SEEN_SOURCE
    assert len(splits["val_seen"]) == 256
    assert synth_math.fact_key("8 + 7 = 15") == "7 + 8 = 15" and synth_math.fact_key("9 - 2 = 7") == "9 - 2 = 7"


def test_held_out_column_sums_are_new_sums_of_trained_digit_steps():
    """The default levels (1 and the procedural 6): a held-out level-6 problem's sum ("47 + 38 =
    85", either order) is in no training row, and each of its digit steps ("7 + 8 = 15") is a
    trained fact, so it can be answered by the procedure and only by it. The worked steps really
    compute the sum: ones, tens, the carry, then the two-digit result."""
    splits = synth_math.make_splits(4000, 512, 128, seed=0, levels=[1, 6])
    trained = {synth_math.fact_key(f) for r in splits["train"] for f in _worked_facts(r)}
    column = [r for r in splits["val"] if r["extra_info"]["level"] == 6]
    assert len(column) == 256
    for r in column:
        *digits, total = r["extra_info"]["facts"]
        assert synth_math.fact_key(total) not in trained, total
        assert {synth_math.fact_key(f) for f in digits} <= trained, r["extra_info"]["solution"]
        a, b = (int(x) for x in total.split(" = ")[0].split(" + "))
        ones, tens = a % 10 + b % 10, a // 10 + b // 10
        want = [f"{a % 10} + {b % 10} = {ones}", f"{a // 10} + {b // 10} = {tens}"] + ([f"{tens} + 1 = {tens + 1}"] if ones > 9 else [])
        assert digits == want and int(r["reward_model"]["ground_truth"]) == a + b
    seen = [r for r in splits["val_seen"] if r["extra_info"]["level"] == 6]
    assert seen and all({synth_math.fact_key(f) for f in r["extra_info"]["facts"]} <= trained for r in seen)


def test_direct_share_changes_only_the_tool_targets():
    """A share of rows answer at once in ``tool_turns`` (the mixed tool-use warm start); the
    problems, prompts and answers are the ones the default split has, and every target is right."""
    plain = synth_math.generate_rows(400, "train", 0, [5])
    mixed = synth_math.generate_rows(400, "train", 0, [5], direct_share=0.6)
    assert [r["prompt"] for r in mixed] == [r["prompt"] for r in plain]
    direct = [r for r in mixed if len(r["extra_info"]["tool_turns"]) == 1]
    assert 0.5 < len(direct) / len(mixed) < 0.7
    for r in mixed:
        turns, answer = r["extra_info"]["tool_turns"], r["reward_model"]["ground_truth"]
        assert turns[-1][0] == "assistant" and math_reward("x", turns[-1][1], answer) == 1.0
        if len(turns) > 1:
            assert turns[0][1].startswith("<tool_call>") and turns[1] == ["tool", answer]
    untouched = [(a, b) for a, b in zip(mixed, plain, strict=True) if len(a["extra_info"]["tool_turns"]) > 1]
    assert untouched and all(a == b for a, b in untouched)


def test_load_prompts_parquet_and_jsonl(tmp_path, tokenizer):
    paths = synth_math.write_splits(tmp_path, 20, 5, seed=0, levels=[1])
    recs, rep = load_prompts([paths["train"]], tokenizer, Cfg)
    assert len(recs) == 20 and rep.kept == 20
    assert recs[0].prompt_ids[-3:] == tokenizer.encode("<|im_start|>assistant\n")[-3:]
    # a limit takes that many from the start of each file (data.val_size over the held-out and
    # the in-distribution validation sets), not from the first file only
    recs, rep = load_prompts([paths["val"], paths["val_seen"]], tokenizer, Cfg, limit=3)
    assert [r.data_source for r in recs] == [synth_math.HELDOUT_SOURCE] * 3 + [synth_math.SEEN_SOURCE] * 3
    assert rep.rows_per_file == {str(paths["val"]): 3, str(paths["val_seen"]): 3}
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}) + "\n")

    class G(Cfg):
        prompt_key = "question"
        answer_key = "answer"

    recs, _ = load_prompts([gsm], tokenizer, G)
    assert recs[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    assert math_reward("gsm", "so \\boxed{4}", recs[0].ground_truth) == 1.0


def test_errors_name_file_row_and_field(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts([tmp_path / "nope.parquet"], tokenizer, Cfg)
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "reward_model": {"ground_truth": "1"}}, {"question": "x"}]), f)
    with pytest.raises(DataError, match=r"bad.parquet: row 1: missing prompt column 'prompt'"):
        load_prompts([f], tokenizer, Cfg)
    f2 = tmp_path / "noanswer.jsonl"
    f2.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(DataError, match=r"row 0: missing ground-truth field 'reward_model.ground_truth'"):
        load_prompts([f2], tokenizer, Cfg)
    f3 = tmp_path / "empty.jsonl"
    f3.write_text(json.dumps({"prompt": "  ", "reward_model": {"ground_truth": "1"}}) + "\n")
    with pytest.raises(DataError, match="row 0: empty prompt"):
        load_prompts([f3], tokenizer, Cfg)
    f4 = tmp_path / "latin1.jsonl"
    f4.write_bytes(b'{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not valid UTF-8"):
        load_prompts([f4], tokenizer, Cfg)
    f5 = tmp_path / "msgs.jsonl"
    f5.write_text(json.dumps({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}) + "\n")
    with pytest.raises(DataError, match=r"prompt\[0\]"):
        load_prompts([f5], tokenizer, Cfg)
    with pytest.raises(DataError, match="unsupported format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_prompts([tmp_path / "x.csv"], tokenizer, Cfg)


def test_too_long_prompts_policy(tmp_path, tokenizer):
    f = tmp_path / "long.jsonl"
    rows = [
        {"prompt": "short", "reward_model": {"ground_truth": "1"}},
        {"prompt": "word " * 200, "reward_model": {"ground_truth": "2"}},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    class C(Cfg):
        max_prompt_length = 40

    recs, rep = load_prompts([f], tokenizer, C)
    assert len(recs) == 1 and rep.skipped_too_long == 1

    class L(C):
        truncation = "left"

    recs, rep = load_prompts([f], tokenizer, L)
    assert len(recs) == 2 and rep.truncated == 1 and len(recs[1].prompt_ids) == 40

    class E(C):
        truncation = "error"

    with pytest.raises(DataError, match="row 1: prompt is .* tokens, over data.max_prompt_length=40"):
        load_prompts([f], tokenizer, E)


def test_sampler_is_deterministic_and_resumable():
    a = PromptSampler(10, 4, seed=3)
    seq = [a.next_batch() for _ in range(5)]
    b = PromptSampler(10, 4, seed=3)
    b.next_batch(), b.next_batch()
    c = PromptSampler(10, 4, seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next_batch() for _ in range(3)] == seq[2:]
    assert all(len(x) == 4 for x in seq)
    with pytest.raises(DataError, match="train_batch_size"):
        PromptSampler(3, 4, seed=0)


def test_sampler_draws_batches_of_any_size_and_resumes_between_them():
    """DAPO's refill draws smaller batches: the position counts prompts, an epoch is still one
    pass without repeats, and a resumed sampler continues mid-epoch with the same prompts."""
    a = PromptSampler(10, 4, seed=3)
    first = a.next_batch() + a.next_batch(3) + a.next_batch(2)
    assert sorted(first) == sorted(set(first)) and len(first) == 9  # no prompt twice in an epoch
    b = PromptSampler(10, 4, seed=3)
    b.next_batch(), b.next_batch(3)
    c = PromptSampler(10, 4, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.next_batch(2) == first[7:]
    assert len(c.next_batch(2)) == 2 and c.epoch == 1  # the tail of 1 is dropped, as for whole batches


def test_preference_split_keeps_each_prompt_on_one_side():
    from hybrid_rl.data.preference import split_by_prompt

    rows = [{"prompt": [{"role": "user", "content": f"q{i // 3}"}], "chosen": f"c{i}", "rejected": "r"} for i in range(30)]
    train, val = split_by_prompt(rows, 0.2)
    assert len(train) + len(val) == 30 and len(val) == 6
    val_prompts = {r["prompt"][0]["content"] for r in val}
    assert not val_prompts & {r["prompt"][0]["content"] for r in train}


def test_load_report_names_what_the_length_limit_did(tmp_path, tokenizer):
    """The start-up summary and metrics count rows skipped for length (they were dropped silently)."""
    import json as _json
    from types import SimpleNamespace

    from hybrid_rl.data.dataset import load_prompts

    f = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "x " * n}], "reward_model": {"ground_truth": "1"}} for n in (2, 3, 80)]
    f.write_text("\n".join(_json.dumps(r) for r in rows))
    cfg = SimpleNamespace(
        prompt_key="prompt", answer_key="reward_model.ground_truth", system_prompt=None, max_prompt_length=40, truncation="skip"
    )
    records, report = load_prompts([f], tokenizer, cfg)
    assert len(records) == 2 and report.skipped_too_long == 1 and report.rows == 3
    line = report.summary("data.train_files", 40)
    assert "3 rows read (rows.jsonl 3), 2 kept, 1 skipped" in line and f"longest {max(report.lengths)} tokens" in line
    assert report.metrics("train")["data/train_skipped_too_long"] == 1.0


def test_batched_tokenisation_equals_one_row_at_a_time(tmp_path, tokenizer, monkeypatch):
    """The loader tokenises rows in batched chat-template calls (across chunk boundaries here):
    every prompt's ids equal ``encode_prompt`` of that row alone, with a system prompt and tools;
    a limit still counts kept prompts, so rows skipped for length do not shorten it."""
    from types import SimpleNamespace

    from hybrid_rl.data import dataset
    from hybrid_rl.data.dataset import encode_prompt

    monkeypatch.setattr(dataset, "_CHUNK", 3)
    f = tmp_path / "rows.jsonl"
    sizes = (80, 2, 5, 80, 3, 7, 1, 9, 4)  # 80: over the length limit
    f.write_text("\n".join(json.dumps({"prompt": "y " * n, "answer": str(n)}) for n in sizes))
    tools = [{"type": "function", "function": {"name": "python", "description": "run code", "parameters": {"type": "object"}}}]
    longest_kept = len(encode_prompt(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "y " * 9}], tools))
    cfg = SimpleNamespace(prompt_key="prompt", answer_key="answer", system_prompt="Be brief.", max_prompt_length=longest_kept + 20,
                          truncation="skip")  # fmt: skip
    records, report = load_prompts([f], tokenizer, cfg, tools=tools)
    assert [r.ground_truth for r in records] == [str(n) for n in sizes if n != 80] and report.skipped_too_long == 2
    for r in records:
        assert r.prompt_ids == encode_prompt(tokenizer, r.messages, tools)
    limited, report = load_prompts([f], tokenizer, cfg, limit=4, tools=tools)
    assert [r.ground_truth for r in limited] == ["2", "5", "3", "7"] and report.rows == 6  # no row past the 4th kept one
