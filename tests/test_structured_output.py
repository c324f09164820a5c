"""Structured outputs on the tiny model with random weights: the grammar mask alone makes every output
match its regex, JSON schema or EBNF grammar, with and without speculation, through the API and the
CLI; the masks never allow ids the tokenizer lacks or control tokens, and compiled grammars are cached."""
import json
import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main as cli_main
from deepinfer.models.checkpoint import make_checkpoint
from deepinfer.models.tokenizer import default_tokenizer
from deepinfer.runtime.structured import GrammarCompiler

MODEL = "v4.1-flash-tiny"
PET_REGEX = r"(cat|dog)s? [0-9]{2,4}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "pet": {"enum": ["cat", "dog", "emu"]}},
          "required": ["ok", "pet"], "additionalProperties": False}
# a sum of one-digit numbers in parentheses, as EBNF and as the regex that accepts the same strings
SUM_GRAMMAR = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9]'
SUM_REGEX = r"\([1-9]( \+ [1-9])?\)"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(MODEL, tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(MODEL, ckpt, max_num_seqs=4, max_model_len=96, speculative=0)


def check_schema(value) -> None:
    assert isinstance(value, dict) and set(value) == {"ok", "pet"}
    assert isinstance(value["ok"], bool) and value["pet"] in ("cat", "dog", "emu")


def test_the_mask_alone_makes_outputs_match(llm):
    sampled = dict(temperature=1.0, max_tokens=24)
    outs = llm.generate(["Hello", "Tell me"] * 2, [SamplingParams(seed=s, regex=PET_REGEX, **sampled) for s in range(2)]
                        + [SamplingParams(seed=s, json_schema=SCHEMA, **sampled) for s in range(2)], use_tqdm=False)
    for o in outs[:2]:
        assert re.fullmatch(PET_REGEX, o.text), o.text
    for o in outs[2:]:
        check_schema(json.loads(o.text))
    for o in outs:  # the grammar ended, so EOS was the one token left: a stop, EOS kept in token_ids
        assert (o.finish_reason, o.token_ids[-1], o.stop_reason) == ("stop", llm.tokenizer.eos_id, llm.tokenizer.eos_id)
    (plain,) = llm.generate(["Hello"], SamplingParams(seed=0, temperature=1.0, max_tokens=8), use_tqdm=False)
    assert not re.fullmatch(PET_REGEX, plain.text)  # (random weights do not write it by themselves)
    (o,) = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=12, grammar=SUM_GRAMMAR), use_tqdm=False)
    assert re.fullmatch(SUM_REGEX, o.text) and o.finish_reason == "stop"


def test_json_schema_as_text_and_greedy(llm):
    (o,) = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=24, json_schema=json.dumps(SCHEMA)),
                        use_tqdm=False)
    check_schema(json.loads(o.text))
    assert ", " in o.text and "\n" not in o.text  # json.dumps' layout


def test_max_tokens_cuts_a_valid_prefix(llm):
    """A budget too short for the grammar ends at max_tokens ("length") with a prefix of a match."""
    (o,) = llm.generate(["Hi"], SamplingParams(temperature=1.0, seed=5, max_tokens=3, regex="[a-z]{40}"),
                        use_tqdm=False)
    assert o.finish_reason == "length" and len(o.token_ids) == 3
    assert re.fullmatch("[a-z]{1,39}", o.text)


def test_speculation_keeps_greedy_tokens(ckpt, llm):
    """Greedy constrained tokens are the same with drafts verified as without (random weights'
    drafts are mostly cut at the first one: the grammar disallows it)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, regex=PET_REGEX)
    (want,) = llm.generate(["Hi"], greedy, use_tqdm=False)
    spec = LLM(MODEL, ckpt, max_num_seqs=1, max_model_len=64, speculative=2)
    (got,) = spec.generate(["Hi"], greedy, use_tqdm=False)
    assert got.token_ids == want.token_ids and re.fullmatch(PET_REGEX, got.text)
    assert spec.last_run_stats["drafts_verified"] > 0


class NoModel:
    """An executor the engine is built on but never steps: `sample` is driven with made-up logits."""
    num_slots, num_pages, page_tokens = 1, 1, 128

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size


def verify_with_grammar(drafts: list[int], targets: list[int | None]):
    """engine.sample over one verify chunk [t*, drafts] whose row j has its maximum at targets[j]
    (None: a flat row, whose masked argmax is the lowest allowed id). Returns (emitted, sequence)."""
    from deepinfer.runtime.engine import LLMEngine, PreparedStep

    tok = default_tokenizer()
    engine = LLMEngine(NoModel(tok.vocab_size), tok, max_num_seqs=1, max_model_len=128)
    rid = engine.add_request(prompt_token_ids=[0, 5], params=SamplingParams(temperature=0, regex=PET_REGEX))
    seq = engine._sequences[rid]
    logits = torch.zeros(1 + len(drafts), tok.vocab_size)
    for j, t in enumerate(targets):
        if t is not None:
            logits[j, t] = 10.0
    prepared = PreparedStep([], [], [engine._sample_request(seq)], [seq], [drafts])
    (emitted,) = engine.sample(prepared, logits)
    return emitted, seq


def fresh_allowed(tokens: list[int]) -> torch.Tensor:
    tok = default_tokenizer()
    grammar = GrammarCompiler(tok, tok.vocab_size).matcher(SamplingParams(regex=PET_REGEX))
    for t in tokens:
        grammar.take(t)
    return grammar.allowed()


def test_drafts_are_checked_by_the_matcher_which_rolls_back_the_rejected():
    tok = default_tokenizer()
    drafts = tok.encode("cats 12")
    # rows 0 and 1 take their drafts, row 2 (flat) rejects d_2 for the lowest id the grammar allows
    emitted, seq = verify_with_grammar(drafts, drafts[:2] + [None] * (len(drafts) - 1))
    lowest = int(fresh_allowed(drafts[:2]).nonzero()[0])
    assert lowest != drafts[2] and emitted == drafts[:2] + [lowest]
    assert torch.equal(seq.grammar.allowed(), fresh_allowed(emitted))  # the matcher holds the emitted tokens only
    # every draft right: all taken, then the row after them
    emitted, seq = verify_with_grammar(drafts, drafts + [tok.eos_id])
    assert emitted == drafts + [tok.eos_id] and seq.grammar.terminated
    # a drafted EOS is left to its row (nothing is masked after an ended grammar): the same output
    emitted, seq = verify_with_grammar(drafts + [tok.eos_id], drafts + [tok.eos_id, None])
    assert emitted == drafts + [tok.eos_id] and seq.grammar.terminated
    # a draft the grammar disallows (and those after it) is never accepted, even where the target
    # would take it: its row samples from the masked distribution
    bad = tok.encode("x")[0]
    emitted, seq = verify_with_grammar([drafts[0], bad, drafts[1]], [drafts[0], bad, drafts[1], None])
    assert emitted[0] == drafts[0] and emitted[1] != bad and len(emitted) == 2
    assert fresh_allowed(drafts[:1])[emitted[1]]
    assert torch.equal(seq.grammar.allowed(), fresh_allowed(emitted))


def test_masks_allow_no_missing_ids_no_control_tokens_and_eos_only_at_the_end():
    tok = default_tokenizer()
    vocab = tok.vocab_size + 64  # a model vocabulary larger than the tokenizer's
    compiler = GrammarCompiler(tok, vocab)
    grammar = compiler.matcher(SamplingParams(regex="ab?"))
    allowed = grammar.allowed()
    assert allowed.shape == (vocab,) and not allowed[tok.vocab_size:].any()
    assert not allowed[sorted(tok.added_token_ids)].any()  # EOS too: "" is no match of ab?
    assert {tok.decode([int(i)]) for i in allowed.nonzero().flatten()} == {"a", "ab"}
    grammar.take(tok.encode("a")[0])
    allowed = grammar.allowed()
    assert allowed[tok.eos_id] and {tok.decode([int(i)]) for i in allowed.nonzero().flatten()} == {"b", tok.decode([1])}
    size = compiler.cache_size_bytes
    compiler.matcher(SamplingParams(regex="ab?"))
    assert compiler.cache_size_bytes == size  # compiled once
    compiler.matcher(SamplingParams(regex="cd?"))
    assert compiler.cache_size_bytes > size


def test_sampler_applies_the_mask_before_its_filters():
    from deepinfer.runtime.sampler import SampleRequest, sample

    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    allowed = torch.tensor([False, False, True, True])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1, seed=0),
                   SamplingParams(temperature=1.0, top_p=0.1, seed=0)):
        # top-k 1 / top-p 0.1 of the masked row keep id 2; of the raw row they would keep id 0
        assert sample(logits, [SampleRequest(params, 0, 1, allowed=[allowed])]) == [2]


def test_cli_generate_with_constraints(ckpt, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "sum.ebnf"
    grammar.write_text(SUM_GRAMMAR)
    base = ["generate", "--model", MODEL, "--weights", str(ckpt), "--prompt", "Hi", "--max-tokens", "24",
            "--speculative", "off", "--max-model-len", "96", "--seed", "0"]
    for flags, check in ((["--regex", PET_REGEX], lambda t: re.fullmatch(PET_REGEX, t)),
                         (["--json-schema", str(schema)], lambda t: check_schema(json.loads(t)) is None),
                         (["--grammar", str(grammar)], lambda t: re.fullmatch(SUM_REGEX, t))):
        assert cli_main(base + flags) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("[0] output: "))
        text = json.JSONDecoder().raw_decode(line[len("[0] output: "):])[0]
        assert check(text), (flags, text)
