"""Structured outputs: a request's `regex`, `json_schema` or `grammar` (EBNF) held by xgrammar.

The grammar is compiled once against the tokenizer's vocabulary (the bytes each id decodes to) and
kept by the engine's `GrammarCompiler`, whose cache returns the compiled grammar of a constraint it
has seen. Each constrained sequence has its own `GrammarMatcher`. Before a row is sampled its
matcher's next-token bitmask becomes a boolean mask the sampler applies first (disallowed logits
-> -inf, then the usual processing and filters), so the constraint alone makes the output valid,
whatever the weights. Ids the tokenizer does not have (a model vocabulary larger than it) and the
added control tokens are never allowed; EOS is allowed exactly where the grammar may end.

Speculation: row j of a verify chunk is masked by the matcher's state after d_0 .. d_{j-1}, so the
matcher accepts the drafts in turn to make the masks; drafts from the first one its row disallows
are dropped (the rule would reject it with certainty: its masked probability is 0). After §5.5 has
decided, the matcher rolls back the drafts it accepted that the verification did not, then
accepts the token the verification drew.
"""
from __future__ import annotations

import json
import re

import torch

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:NN: " and sometimes a failed check
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


# JSON in json.dumps' layout (", " and ": ", no newlines): with any whitespace allowed, a model can
# spend its whole budget on whitespace between two tokens of the value (random weights always do)
JSON_LAYOUT = {"any_whitespace": False}


def constraint_of(params) -> tuple[str, str] | None:
    """(kind, source) of the params' constraint, or None: ("regex", re), ("json_schema", schema as
    JSON text) or ("grammar", EBNF)."""
    if params.regex is not None:
        return "regex", params.regex
    if params.json_schema is not None:
        schema = params.json_schema
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


def error_line(error: Exception) -> str:
    """The first line of an xgrammar error without its C++ source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = _CPP_PREFIX.sub("", text)
    return text.split(". The JSON string is:")[0]


def check_constraint(kind: str, source: str) -> str | None:
    """None if `source` parses as a `kind` constraint, else the one-line reason it does not
    (checked without a tokenizer, so SamplingParams can refuse it when it is made)."""
    import xgrammar

    parse = {"regex": xgrammar.Grammar.from_regex, "grammar": xgrammar.Grammar.from_ebnf,
             "json_schema": lambda schema: xgrammar.Grammar.from_json_schema(schema, **JSON_LAYOUT)}[kind]
    try:
        parse(source)
    except (RuntimeError, ValueError, TypeError) as e:
        return error_line(e)
    return None


class GrammarCompiler:
    """The engine's compiler: one xgrammar TokenizerInfo of the tokenizer, padded to the model's
    vocabulary, and a compile cache (built on first use: importing xgrammar takes seconds)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None

    def _ensure(self):
        if self._compiler is None:
            import xgrammar

            added = self.tokenizer.added_token_ids
            # added tokens get no bytes: xgrammar never allows an empty token, and control tokens
            # are no text a constraint could match (EOS, the stop token, is allowed at the end)
            vocab = [b"" if i in added else token for i, token in enumerate(self.tokenizer.token_bytes)]
            if len(vocab) > self.vocab_size:
                raise ValueError(f"the tokenizer has {len(vocab)} ids, more than the model's {self.vocab_size}")
            info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                          stop_token_ids=[self.tokenizer.eos_id])
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def compile(self, kind: str, source: str):
        compiler = self._ensure()
        compile_fn = {"regex": compiler.compile_regex, "grammar": compiler.compile_grammar,
                      "json_schema": lambda schema: compiler.compile_json_schema(schema, **JSON_LAYOUT)}[kind]
        try:
            return compile_fn(source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{kind}: {error_line(e)}") from None

    def matcher(self, params) -> "SequenceGrammar | None":
        constraint = constraint_of(params)
        if constraint is None:
            return None
        return SequenceGrammar(self.compile(*constraint), self.vocab_size)

    @property
    def cache_size_bytes(self) -> int:
        return self._compiler.get_cache_size_bytes() if self._compiler is not None else 0


class SequenceGrammar:
    """One sequence's matcher: the tokens it allows next, and the tokens it has taken."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)  # (xgrammar 0.2 rolls back any number of tokens)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """Bool [vocab]: the ids the grammar allows next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask[0]
        return ((words.unsqueeze(-1) >> self._bits) & 1).flatten()[:self.vocab_size].bool()

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(int(token))

    def take(self, token: int) -> None:
        """Accept a token its mask allowed (anything else is a bug, not input)."""
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar matcher refused token {token}, which its mask allowed")

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()
