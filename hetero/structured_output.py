"""Structured output: a grammar per sequence, applied as a mask over the vocabulary.

Grammars are compiled and matched by llguidance (the engine vLLM and SGLang use next to
xgrammar): `grammar_of` turns vLLM's `StructuredOutputsParams` into an llguidance
grammar (a JSON schema closed to the properties it lists: `closed_schema`), and each
sequence gets a `SequenceGrammar` that tracks the tokens it has emitted.

`SequenceGrammar.row_masks(tree)` gives the allowed tokens at every sampling row of a step:
the row after the sequence's last token, and, under speculation, the row after each draft
node, with the grammar advanced along that node's path and rolled back afterwards. A draft
token the grammar forbids has probability 0 in its parent's row, so tree verification
rejects it as it rejects any token the target would not emit; the output stays the
constrained distribution whether or not anything was drafted.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from hetero.core.protocols import TokenTree
from hetero.core.sampling_params import StructuredOutputsParams

# JSON without free whitespace between tokens (vLLM's `disable_any_whitespace`): a model
# that may put any whitespace anywhere can loop on it, small models often do.
_JSON_OPTIONS = {"whitespace_flexible": False}


# Keywords whose values map names to subschemas; whose subschemas apply to the same object as
# the schema holding them (closing one would forbid the properties the others list); whose
# values are data, not schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SAME_OBJECT = ("allOf", "if", "then", "else", "not", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required")


def closed_schema(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that lists its properties and says
    nothing of others allows no others ("additionalProperties": false).

    vLLM's default structured-output backend (xgrammar, in its default strict mode) generates
    no property a schema does not list; JSON Schema itself allows them, and a small model
    given the freedom invents keys (a tool call's arguments then name parameters the tool does
    not have). A schema that sets additionalProperties keeps what it says. Subschemas that
    apply to the same object as their parent (allOf, if / then / else, not,
    dependentSchemas) are left open at their top.
    """
    return _close(schema, closable=True)


def _close(node: Any, closable: bool) -> Any:
    if isinstance(node, list):
        return [_close(item, True) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {}
    for key, value in node.items():
        if key in _DATA:
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _close(sub, True) for name, sub in value.items()}
        elif key == "dependentSchemas" and isinstance(value, dict):
            closed[key] = {name: _close(sub, False) for name, sub in value.items()}
        elif key in _SAME_OBJECT:
            closed[key] = [_close(sub, False) for sub in value] if isinstance(value, list) else _close(value, False)
        else:
            closed[key] = _close(value, True)
    lists_properties = "properties" in node or "patternProperties" in node
    if closable and lists_properties and "additionalProperties" not in node and "unevaluatedProperties" not in node:
        closed["additionalProperties"] = False
    return closed


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec`; ValueError (naming the field) when it does not compile."""
    try:
        if spec.json is not None:
            schema = closed_schema(json.loads(spec.json) if isinstance(spec.json, str) else spec.json)
            grammar, field = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS), "json"
        elif spec.json_object:
            grammar, field = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS), "json_object"
        elif spec.regex is not None:
            grammar, field = llguidance.LLMatcher.grammar_from_regex(spec.regex), "regex"
        elif spec.choice is not None:
            rule = " | ".join(_lark_literal(choice) for choice in spec.choice)
            grammar, field = llguidance.LLMatcher.grammar_from_lark(f"start: {rule}"), "choice"
        else:
            grammar, field = llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar)), "grammar"
    except (ValueError, TypeError, GbnfToLarkError) as exc:
        raise ValueError(f"structured_outputs: cannot compile the constraint: {exc}") from exc
    message = llguidance.LLMatcher.validate_grammar(grammar)  # "" when valid
    if message:
        raise ValueError(f"structured_outputs.{field} is not a valid constraint: {message.strip()}")
    return grammar


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's int32 bitmask [rows, words] (bit t % 32 of word t // 32 allows token t)
    as a bool tensor [rows, vocab_size], on the bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _allows(words: np.ndarray, token: int) -> bool:
    return bool((words[token >> 5] >> np.uint32(token & 31)) & np.uint32(1))


class GrammarCompiler:
    """The engine's link to llguidance: the tokenizer's token table, built once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def new_states(self, spec: StructuredOutputsParams, count: int) -> list["SequenceGrammar"]:
        """`count` independent states at the grammar's start (one per sequence of a request)."""
        grammar = grammar_of(spec)
        states = []
        for _ in range(count):
            matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs: {matcher.get_error()}")
            states.append(SequenceGrammar(matcher, self.vocab_size, self._tokenizer.eos_token, self.eos_token_ids))
        return states


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, grammar_eos: int, eos_token_ids: Sequence[int]):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._grammar_eos = grammar_eos
        self._eos_token_ids = list(eos_token_ids)
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def _as_grammar_token(self, token: int) -> int:
        return self._grammar_eos if token in self._eos_token_ids else token

    def accept(self, token: int) -> None:
        """Advance past an emitted token (the model's EOS ids all count as the grammar's end)."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(self._as_grammar_token(token))

    def _mask(self) -> np.ndarray:
        """The allowed tokens here, packed (uint32 words); the model's EOS ids wherever the
        grammar allows its end, and alone once it is complete or stuck."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        words = self._bitmask[0].numpy().view(np.uint32).copy()
        if _allows(words, self._grammar_eos) or not words.any():
            for eos in self._eos_token_ids:
                words[eos >> 5] |= np.uint32(1 << (eos & 31))
        return words

    def _rollback(self, steps: list[tuple[int, bool]]) -> None:
        counted = sum(1 for _, was_counted in steps if was_counted)
        if counted:
            self._matcher.rollback(counted)

    def row_masks(self, tree: Optional[TokenTree], device: torch.device) -> torch.Tensor:
        """bool [1 + len(tree), vocab]: row 0 after the sequence's tokens, row i + 1 after draft node i.

        Nodes come parents first, so each node's path is its parent's plus its token. A
        node whose token its parent's row forbids is never accepted; its row (and its
        subtree's) is left unconstrained, since verification never reads it.
        """
        masks = [self._mask()]
        everything = np.full_like(masks[0], 0xFFFFFFFF)
        if tree is not None and len(tree):
            # The path the matcher stands on: (grammar token, whether the matcher counted it;
            # a stopped matcher takes nothing more, so a token after the end is not counted).
            on_path: list[tuple[int, bool]] = []
            paths: list[Optional[list[int]]] = []
            for token, parent in zip(tree.token_list, tree.parent_list):
                parent_path = [] if parent < 0 else paths[parent]
                if parent_path is None or not _allows(masks[parent + 1], token):
                    paths.append(None)
                    masks.append(everything)
                    continue
                path = parent_path + [self._as_grammar_token(token)]
                common = 0
                while common < min(len(on_path), len(path)) and on_path[common][0] == path[common]:
                    common += 1
                self._rollback(on_path[common:])
                del on_path[common:]
                for grammar_token in path[common:]:
                    counted = not self._matcher.is_stopped()
                    if counted:
                        self._matcher.consume_token(grammar_token)
                    on_path.append((grammar_token, counted))
                paths.append(path)
                masks.append(self._mask())
            self._rollback(on_path)
        # Packed on the host, unpacked on the device: 32 times fewer bytes cross.
        packed = torch.from_numpy(np.stack(masks).view(np.int32))
        return unpack_bitmask(packed.to(device), self._vocab_size)
