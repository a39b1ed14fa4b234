"""Prompt datasets: verl-style parquet/jsonl files in, tokenised prompts with ground truth out.

A row needs a prompt (``data.prompt_key``: chat messages ``[{role, content}, ...]`` or a plain
string, which becomes one user message) and a ground truth (``data.answer_key``, a dotted path:
``reward_model.ground_truth`` for verl files, ``answer`` for GSM8K's jsonl, whose ``#### 72``
suffix the math reward understands). Errors name the file, the row and the field; nothing is
dropped silently: prompts over ``data.max_prompt_length`` are skipped *and counted*, or
truncated, or rejected, as ``data.truncation`` says.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hybrid_rl.env import cache_root
from hybrid_rl.errors import DataError  # re-exported


class PromptSettings(Protocol):
    """The part of the ``data`` config prompts are read with (``DataConfig`` has it)."""

    prompt_key: str
    answer_key: str
    system_prompt: str | None
    max_prompt_length: int
    truncation: str


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    ground_truth: Any
    data_source: str
    extra_info: dict
    messages: list[dict]
    source: str  # "file:row" for error messages and debugging


@dataclass
class LoadReport:
    rows: int = 0
    kept: int = 0
    skipped_too_long: int = 0
    truncated: int = 0
    files: list[str] = field(default_factory=list)
    rows_per_file: dict[str, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)  # prompt tokens of every row read, before truncation

    def summary(self, key: str, limit: int) -> str:
        """One line for the log: rows per file, what the length limit did, prompt-length percentiles."""
        files = ", ".join(f"{Path(f).name} {n}" for f, n in self.rows_per_file.items())
        xs = sorted(self.lengths) or [0]
        pct = ", ".join(f"p{q} {xs[min(len(xs) - 1, len(xs) * q // 100)]}" for q in (50, 90, 99))
        return (
            f"{key}: {self.rows} rows read ({files}), {self.kept} kept, {self.skipped_too_long} skipped and "
            f"{self.truncated} truncated over data.max_prompt_length={limit} (longest {xs[-1]} tokens); prompt tokens {pct}"
        )

    def metrics(self, split: str) -> dict[str, float]:
        return {f"data/{split}_rows": float(self.rows), f"data/{split}_kept": float(self.kept),
                f"data/{split}_skipped_too_long": float(self.skipped_too_long), f"data/{split}_truncated": float(self.truncated)}  # fmt: skip


def synth_math_paths(synth: Any) -> dict[str, Path]:
    """Generate (once, cached by its settings) the synthetic math splits; returns their paths."""
    from hybrid_rl.data.synth_math import GENERATOR_VERSION, write_splits

    key = [
        GENERATOR_VERSION,
        synth.n_train,
        synth.n_val,
        list(synth.levels),
        synth.seed,
        synth.heldout_fraction,
        synth.n_val_seen,
    ]
    if synth.direct_share:  # keyed only when set: the other tasks' caches stay where they were
        key.append(synth.direct_share)
    key = json.dumps(key)
    out = cache_root() / "data" / f"synth_math-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    paths = {split: out / f"{split}.parquet" for split in ("train", "val", "val_seen")}
    if not all(p.exists() for p in paths.values()):
        write_splits(out, synth.n_train, synth.n_val, synth.seed, list(synth.levels), synth.direct_share,
                     synth.heldout_fraction, synth.n_val_seen)  # fmt: skip
    return paths


def resolve_files(files: list[str], split: str, synth: Any) -> list[Path]:
    """Paths for ``files``; ``builtin:synth_math`` is the generated task's ``split``, and for
    ``val`` both of its validation sets (held-out facts, then new questions over training facts)."""
    out = []
    for f in files:
        if f == "builtin:synth_math":
            paths = synth_math_paths(synth)
            out += [paths["val"], paths["val_seen"]] if split == "val" and synth.n_val_seen else [paths[split]]
        else:
            out.append(Path(f))
    return out


def read_rows(path: Path) -> list[dict]:
    """All rows of a parquet or jsonl file as dicts; errors name the file (and line)."""
    if not path.exists():
        raise DataError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataError(f"cannot read parquet file {str(path)!r}: {e}") from e
    if suffix in (".jsonl", ".json"):
        rows = []
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
        return rows
    raise DataError(f"data file {str(path)!r}: unsupported format {suffix!r} (use .parquet or .jsonl)")


def get_path(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def row_messages(row: dict, prompt_key: str, where: str, system_prompt: str | None) -> list[dict]:
    try:
        prompt = get_path(row, prompt_key)
    except KeyError:
        prompt = None
    if prompt is None:
        present = ", ".join(k for k, v in row.items() if v is not None)
        raise DataError(f"{where}: missing prompt column {prompt_key!r} (data.prompt_key); row has: {present}")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list | tuple) and prompt:
        messages = []
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: {prompt_key}[{j}] must be a {{role, content}} message with string fields")
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise DataError(f"{where}: {prompt_key} must be a string or a non-empty list of messages, got {type(prompt).__name__}")
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: empty prompt")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def encode_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def check_chat_template(tokenizer: Any, model_path: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the tokenizer at {model_path!r} has no chat template; prompts are chat messages, so use an "
            "instruct/chat checkpoint or add a chat_template to its tokenizer_config.json"
        )


def encode_prompts(tokenizer: Any, conversations: list[list[dict]], tools: list[dict] | None = None) -> list[list[int]]:
    """:func:`encode_prompt` of each conversation in one call of transformers' batched
    ``apply_chat_template`` (the same rendering and tokenizer, one Rust batch instead of one call
    per row: 20,000 prompts 2.6 s -> 1.4 s on 2 cores)."""
    if not conversations:
        return []
    ids = tokenizer.apply_chat_template(conversations, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [list(x) for x in ids]


def _validated_row(row: Any, where: str, prompt_key: str, answer_key: str, system_prompt: str | None) -> tuple[list[dict], Any]:
    """A row's chat messages and ground truth, or a :class:`DataError` naming the row and field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    messages = row_messages(row, prompt_key, where, system_prompt)
    try:
        gt = get_path(row, answer_key)
    except KeyError:
        raise DataError(f"{where}: missing ground-truth field {answer_key!r} (data.answer_key); row has: {', '.join(row)}") from None
    if gt is None or (isinstance(gt, str) and not gt.strip()):
        raise DataError(f"{where}: empty ground truth in {answer_key!r}")
    return messages, gt


def _file_records(path: Path, tokenizer: Any, cfg: PromptSettings, limit: int, tools: list[dict] | None, report: LoadReport) -> list[PromptRecord]:
    """One file's prompts: rows validated and tokenised ``_CHUNK`` at a time (a bad row fails
    before its chunk is tokenised), until ``limit`` are kept (0: all)."""
    # Read once: an OmegaConf attribute costs ~40 us, and four per row were 3 s of 20,000 rows.
    keys = (cfg.prompt_key, cfg.answer_key, cfg.system_prompt)
    max_len, truncation = cfg.max_prompt_length, cfg.truncation
    rows, records = enumerate(read_rows(path)), []
    while not limit or len(records) < limit:
        chunk = []
        for i, row in itertools.islice(rows, min(limit - len(records), _CHUNK) if limit else _CHUNK):
            where = f"{path}: row {i}"
            report.rows += 1
            report.rows_per_file[str(path)] = report.rows_per_file.get(str(path), 0) + 1
            messages, gt = _validated_row(row, where, *keys)
            extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
            chunk.append((where, messages, gt, str(row.get("data_source", path.stem)), dict(extra), f"{path}:{i}"))
        if not chunk:
            break
        for (where, messages, gt, source, extra, row_id), full in zip(chunk, encode_prompts(tokenizer, [c[1] for c in chunk], tools), strict=True):
            report.lengths.append(len(full))
            ids = full
            if len(full) > max_len:
                if truncation == "skip":
                    report.skipped_too_long += 1
                    continue
                if truncation == "error":
                    raise DataError(f"{where}: prompt is {len(full)} tokens, over data.max_prompt_length={max_len}")
                ids = full[-max_len:] if truncation == "left" else full[:max_len]
                report.truncated += 1
            records.append(PromptRecord(ids, gt, source, extra, messages, row_id))
    return records


_CHUNK = 2048  # rows tokenised per batched call


def load_prompts(
    files: list[Path], tokenizer: Any, cfg: PromptSettings, limit: int = 0, tools: list[dict] | None = None
) -> tuple[list[PromptRecord], LoadReport]:
    """Read, validate and tokenise prompts from ``files`` (the ``data`` config gives keys and
    limits); ``limit`` > 0: at most that many kept from the start of each file."""
    report = LoadReport(files=[str(f) for f in files])
    records = [r for path in files for r in _file_records(path, tokenizer, cfg, limit, tools, report)]
    report.kept = len(records)
    if not records:
        raise DataError(
            f"no usable prompts in {', '.join(report.files)} ({report.rows} rows, "
            f"{report.skipped_too_long} over data.max_prompt_length={cfg.max_prompt_length})"
        )
    return records, report


class PromptSampler:
    """Deterministic epoch-shuffled batches of prompt indices, resumable from ``state_dict``."""

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size > n:
            raise DataError(f"data.train_batch_size={batch_size} is larger than the {n} training prompts")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next_batch(self, count: int | None = None) -> list[int]:
        """The next ``count`` indices (``batch_size`` by default; the tail of an epoch that does
        not fill them is dropped). The position counts prompts, so batches may differ in size."""
        count = self.batch_size if count is None else min(count, self.n)
        if self.pos + count > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._make_order()
        batch = self._order[self.pos : self.pos + count]
        self.pos += count
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
