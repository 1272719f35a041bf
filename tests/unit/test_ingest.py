"""Stage 1: prompt validation with line numbers, dedup, the hash split, the embedding cache and the prompt sampler."""

import codecs
import json
import random

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.stages.ingest import DataConfig, EmbeddingCache, PromptSampler, in_eval_split, ingest

pytestmark = pytest.mark.unit

NOT_UTF8 = b"caf\xe9 at night"  # latin-1, not UTF-8
TOO_LONG = b"x" * 21
DEEP = 100_000


def write(tmp_path, name: str, lines: list[bytes]) -> str:
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def run(source: str, **overrides):
    return ingest(DataConfig(source=source, max_prompt_chars=20, eval_fraction=0.0, **overrides))


def test_txt_counts_every_bad_kind_with_line_numbers(tmp_path):
    lines = [b"a cat", b"", b"   \t", TOO_LONG, NOT_UTF8, b"a  cat ", b"a dog"]
    prompts = run(write(tmp_path, "p.txt", lines))
    assert [p.text for p in prompts.train] == ["a cat", "a dog"]
    assert [p.line for p in prompts.train] == [1, 7]
    assert prompts.report.skipped == {
        "undecodable": [5],
        "empty": [2],
        "whitespace_only": [3],
        "too_long": [4],
        "duplicate": [6],
    }
    assert prompts.report.counts["duplicate"] == 1 and prompts.report.kept == 2


def test_jsonl_counts_bad_json_missing_column_and_keeps_metadata(tmp_path):
    lines = [
        json.dumps({"prompt": "a cat", "style": "anime", "fps": 24}).encode(),
        b"{not json",
        json.dumps({"caption": "no prompt column"}).encode(),
        json.dumps({"prompt": 3}).encode(),
        b'{"prompt": "' + NOT_UTF8 + b'"}',
        json.dumps({"prompt": "  "}).encode(),
        json.dumps({"prompt": "x" * 21}).encode(),
        b"",
        json.dumps({"prompt": "a\tcat"}).encode(),
    ]
    prompts = run(write(tmp_path, "p.jsonl", lines))
    assert [(p.text, p.metadata, p.line) for p in prompts.train] == [("a cat", {"style": "anime", "fps": 24}, 1)]
    assert prompts.report.skipped == {
        "undecodable": [2, 3, 4, 5],
        "empty": [8],
        "whitespace_only": [6],
        "too_long": [7],
        "duplicate": [9],
    }


def test_csv_counts_bad_rows_at_their_first_line_and_keeps_metadata(tmp_path):
    lines = [
        b"id,prompt,style",
        b'1,"a cat\nin two lines",anime',
        b"2,,real",
        b"3,   ,real",
        b"4," + TOO_LONG + b",real",
        b"5," + NOT_UTF8 + b",real",
        b"6,missing a field",
        b"",
        b"7,a cat in two lines,anime",
        b"8,a dog,real",
    ]
    prompts = run(write(tmp_path, "p.csv", lines))
    assert [(p.text, p.metadata, p.line) for p in prompts.train] == [
        ("a cat in two lines", {"id": "1", "style": "anime"}, 2),
        ("a dog", {"id": "8", "style": "real"}, 11),
    ]
    assert prompts.report.skipped == {
        "undecodable": [7, 8],
        "empty": [4, 9],
        "whitespace_only": [5],
        "too_long": [6],
        "duplicate": [10],
    }


def test_csv_without_the_prompt_column_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no 'prompt' column"):
        run(write(tmp_path, "p.csv", [b"caption", b"a cat"]))


@pytest.mark.parametrize("name,lines", [("p.txt", [b"", b"  "]), ("p.jsonl", [b"{bad"]), ("p.txt", [])])
def test_no_usable_prompt_is_a_one_line_user_error(tmp_path, name, lines):
    with pytest.raises(UserError) as error:
        run(write(tmp_path, name, lines))
    assert "no usable prompt" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("source", ["prompts.parquet", "/does/not/exist.txt", "s3://bucket-only.txt"])
def test_bad_sources_are_user_errors(source):
    with pytest.raises(UserError):
        ingest(DataConfig(source=source))


def test_split_is_stable_across_runs_and_independent_of_order(tmp_path):
    prompts = [f"prompt number {i}".encode() for i in range(400)]
    first = ingest(DataConfig(source=write(tmp_path, "a.txt", prompts), eval_fraction=0.25))
    shuffled = prompts[:]
    random.Random(0).shuffle(shuffled)
    second = ingest(DataConfig(source=write(tmp_path, "b.txt", shuffled), eval_fraction=0.25))
    held_out = {p.text for p in first.eval}
    assert held_out == {p.text for p in second.eval}
    assert 60 < len(held_out) < 140  # about a quarter
    assert not held_out & {p.text for p in first.train}
    assert held_out != {
        p.text
        for p in ingest(
            DataConfig(source=write(tmp_path, "a.txt", prompts), eval_fraction=0.25, split_salt="other")
        ).eval
    }


def test_split_depends_only_on_salt_and_prompt():
    assert in_eval_split("a cat", "s", 0.5) == in_eval_split("a cat", "s", 0.5)
    assert not in_eval_split("a cat", "s", 0.0)


# --- Embedding cache -------------------------------------------------------------------------------------------


class CountingEncoder:
    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        self.calls.append(list(prompts))
        codes = torch.tensor([[float(len(p)), float(sum(map(ord, p)))] for p in prompts])
        return {"hidden": codes.unsqueeze(1).repeat(1, 3, 1), "mask": torch.ones(len(prompts), 3, dtype=torch.bool)}


def test_cache_encodes_each_prompt_once_and_returns_rows_in_order(tmp_path):
    cache, encoder = EmbeddingCache(tmp_path), CountingEncoder()
    first = cache.get_or_encode("encoder-a", ["a cat", "a dog", "a cat"], encoder)
    assert encoder.calls == [["a cat", "a dog"]] and (cache.hits, cache.misses) == (0, 2)
    second = EmbeddingCache(tmp_path).get_or_encode("encoder-a", ["a dog", "a cat", "a cow"], encoder)
    assert encoder.calls[1:] == [["a cow"]]
    assert torch.equal(second["hidden"][0], first["hidden"][1]) and torch.equal(second["hidden"][1], first["hidden"][0])
    assert second["mask"].dtype == torch.bool and second["hidden"].shape == (3, 3, 2)
    assert not list(tmp_path.rglob("*.tmp"))


def test_cache_misses_for_another_encoder_identity(tmp_path):
    cache, encoder = EmbeddingCache(tmp_path), CountingEncoder()
    cache.get_or_encode("encoder-a", ["a cat"], encoder)
    cache.get_or_encode("encoder-b", ["a cat"], encoder)
    assert encoder.calls == [["a cat"], ["a cat"]] and cache.misses == 2


def test_corrupted_cache_file_is_encoded_again(tmp_path, caplog):
    cache, encoder = EmbeddingCache(tmp_path), CountingEncoder()
    expected = cache.get_or_encode("encoder-a", ["a cat", "a dog"], encoder)
    victim = sorted(tmp_path.rglob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:20])
    again = cache.get_or_encode("encoder-a", ["a cat", "a dog"], encoder)
    assert len(encoder.calls[1]) == 1 and "unreadable" in caplog.text
    assert all(torch.equal(again[name], expected[name]) for name in expected)
    assert EmbeddingCache(tmp_path).get_or_encode("encoder-a", ["a cat", "a dog"], encoder) and len(encoder.calls) == 2


def test_encoder_returning_the_wrong_number_of_rows_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="rows"):
        EmbeddingCache(tmp_path).get_or_encode("e", ["a", "b"], lambda prompts: {"hidden": torch.zeros(1, 4)})


# --- Prompt sampler --------------------------------------------------------------------------------------------


def draw(num_prompts, prompts_per_rank, world, seed, iterations):
    samplers = [PromptSampler(num_prompts, prompts_per_rank, rank, world, seed) for rank in range(world)]
    return [[next(sampler) for sampler in samplers] for _ in range(iterations)]


@pytest.mark.parametrize("num_prompts", [7, 10, 13])
def test_ranks_get_disjoint_prompts_and_an_epoch_sees_every_prompt_once(num_prompts):
    world, per_rank = 3, 2  # 6 prompts per iteration, which never divides the epoch evenly here
    iterations = draw(num_prompts, per_rank, world, seed=1, iterations=4 * num_prompts)
    for batch in iterations:
        flat = [index for rank_indices in batch for index in rank_indices]
        assert len(flat) == len(set(flat)) == world * per_rank
    stream = [index for batch in iterations for rank_indices in batch for index in rank_indices]
    for epoch in range(len(stream) // num_prompts):
        assert sorted(stream[epoch * num_prompts : (epoch + 1) * num_prompts]) == list(range(num_prompts))


def test_epochs_are_different_seeded_permutations():
    stream = [i for batch in draw(8, 4, 1, seed=5, iterations=4) for i in batch[0]]
    assert stream[:8] != stream[8:] and stream == [i for batch in draw(8, 4, 1, 5, 4) for i in batch[0]]
    assert stream != [i for batch in draw(8, 4, 1, seed=6, iterations=4) for i in batch[0]]


def test_resume_from_state_continues_identically():
    original = PromptSampler(11, 3, rank=1, world=2, seed=0)
    for _ in range(4):  # 24 prompts drawn: the 4th iteration crossed the boundary at 22
        next(original)
    state = json.loads(json.dumps(original.state_dict()))  # as it travels through a checkpoint
    assert (state["epoch"], state["position"], len(state["carried_over"])) == (2, 2, 4)
    resumed = PromptSampler(11, 3, rank=1, world=2, seed=0)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(20)] == [next(original) for _ in range(20)]


def test_resume_with_another_prompt_count_is_refused():
    state = PromptSampler(11, 1, 0, 1, 0).state_dict()
    with pytest.raises(UserError, match="11 prompts"):
        PromptSampler(12, 1, 0, 1, 0).load_state_dict(state)


def test_too_few_prompts_for_the_ranks_is_a_user_error():
    with pytest.raises(UserError):
        PromptSampler(5, 2, 0, 3, 0)


# --- Encodings -------------------------------------------------------------------------------------------------


JSONL_TEXT = '{"prompt": "un café la nuit", "style": "noir"}\n{"prompt": "東京の雨", "style": "anime"}\n'


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_files_with_a_wide_byte_order_mark_are_decoded(tmp_path, codec):
    path = tmp_path / "p.jsonl"
    data = JSONL_TEXT.encode(codec)
    bom = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE}.get(codec, b"")
    path.write_bytes(bom + data)  # "utf-16"/"utf-32" write their own mark
    prompts = run(str(path))
    assert [(p.text, p.metadata) for p in prompts.train] == [
        ("un café la nuit", {"style": "noir"}),
        ("東京の雨", {"style": "anime"}),
    ]


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(codecs.BOM_UTF8 + b"a cat\na dog\n")
    assert [p.text for p in run(str(path)).train] == ["a cat", "a dog"]


@pytest.mark.parametrize(
    "data, message",
    [
        ("a cat\na dog\n".encode("utf-16-le"), "UTF-16 or UTF-32 without a byte-order mark"),
        (codecs.BOM_UTF16_LE + "a cat\n".encode("utf-16-le") + b"x", "not valid UTF-16"),
        ("café\nthé\nnaïve\na dog\n".encode("latin-1"), "3 of 4 lines hold invalid bytes"),
    ],
)
def test_text_in_an_undeclared_encoding_is_refused_in_one_line(tmp_path, data, message):
    path = tmp_path / "p.txt"
    path.write_bytes(data)
    with pytest.raises(UserError) as error:
        run(str(path))
    assert message in str(error.value) and str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_stray_nul_skips_its_line_only(tmp_path):
    prompts = run(write(tmp_path, "p.txt", [b"a cat", b"a d\x00og", b"a bird", b"a fish"]))
    assert [p.text for p in prompts.train] == ["a cat", "a bird", "a fish"]
    assert prompts.report.skipped["undecodable"] == [2]


def test_metadata_for_follows_the_ids_a_rollout_gives_its_samples(tmp_path):
    lines = [json.dumps({"prompt": f"prompt {i}", "style": f"s{i}"}).encode() for i in range(3)]
    prompts = run(write(tmp_path, "p.jsonl", lines))
    assert prompts.metadata_for(torch.tensor([2, 2, 0])) == [{"style": "s2"}, {"style": "s2"}, {"style": "s0"}]


# A line the JSON reader cannot take (nested past its limit, an integer past Python's 4300 digits) is a bad line.
BAD_LINES = {
    "nested-list": '{"prompt": "a", "m": ' + "[" * DEEP + "]" * DEEP + "}",
    "nested-object": '{"prompt": "a", "m": ' + '{"k": ' * DEEP + "1" + "}" * DEEP + "}",
    "nested-whole-line": "[" * DEEP + "]" * DEEP,
    "huge-integer": '{"prompt": "a", "n": ' + "9" * 4301 + "}",  # one past the 4300 digits int() converts
    "huge-negative-integer": '{"prompt": "a", "n": -' + "1" * 5000 + "}",
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_prompt_line_the_json_reader_cannot_take_is_skipped_and_counted(tmp_path, kind):
    lines = [json.dumps({"prompt": "a cat"}), BAD_LINES[kind], json.dumps({"prompt": "a dog", "n": 10**4000})]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    prompts = ingest(DataConfig(source=str(path), eval_fraction=0.0))
    assert [(prompt.text, prompt.line) for prompt in prompts.train] == [("a cat", 1), ("a dog", 3)]
    assert prompts.report.skipped["undecodable"] == [2]
