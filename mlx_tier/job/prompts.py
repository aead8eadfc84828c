"""Prompts built from documents, and the text taken back from the model.

Document text is data, never control. A document may contain strings that
are the tokenizer's special tokens (``<|im_end|>``, ``<|im_start|>assistant``,
``<|endoftext|>``, ``</s>``, ``<think>``): tokenised as such they would end
the user's turn or inject a role. So a prompt is assembled from two kinds of
pieces: the chat template's own text (its role headers and turn ends),
tokenised with special tokens; and the message content (instruction and
document), tokenised by the tokenizer's normalizer, pre-tokenizer and model
only, with no added token matched — the way ``split_special_tokens`` works in
Hugging Face tokenizers, extended to added tokens that are not marked special
(Qwen3's ``<think>``).

The model's output is read back by two rules: the reasoning rule (only for
models whose chat template or config says they reason) and the sentence rule
(a summary cut by the token limit ends at its last complete sentence, found
by the ``sentencex`` sentence segmenter).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Marks where a message's content goes while the chat template is rendered
# (around the message's index); private-use characters, so no template or
# tokenizer gives them meaning.
_SLOT = "\ue000mlx-tier-content\ue000"


def encode_data(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as plain text: no special or added token is matched.

    Args:
        tokenizer: a Hugging Face tokenizer, or mlx-lm's ``TokenizerWrapper``
            around one.

    Returns:
        ids ``[T]`` that decode back to ``text``. For text without added-token
        strings they equal ``tokenizer.encode(text, add_special_tokens=False)``.

    Fast tokenizers run the backend's pipeline (normalizer, pre-tokenizer,
    model) directly, skipping its added-token matcher; slow tokenizers use
    ``split_special_tokens=True``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
    return [t.id for p in pieces for t in backend.model.tokenize(p)]


def _specials_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids ``encode`` adds before and after a text (e.g. ``[<s>]``, ``[]``)."""
    full = list(tokenizer.encode("a"))
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def build_prompt(tokenizer, instruction: str, text: str) -> list[int]:
    """Token ids ``[T]`` of the prompt for one text: the instruction, a blank
    line, the text; in the model's chat template as the user's message, else
    followed by ``Summary:``.

    The template's own parts are tokenised with special tokens, the message
    (instruction and text) as data (:func:`encode_data`).

    Raises:
        ValueError: the chat template does not keep the message verbatim.
    """
    content = f"{instruction}\n\n{text.strip()}"
    if not getattr(tokenizer, "chat_template", None):
        before, after = _specials_around(tokenizer)
        return before + encode_data(tokenizer, content + "\n\nSummary:") + after
    return build_chat_prompt(tokenizer, [{"role": "user", "content": content}])


def _slot(i: int) -> str:
    return f"{_SLOT}{i}{_SLOT}"


_SLOTS = re.compile(re.escape(_SLOT) + r"(\d+)" + re.escape(_SLOT))


def build_chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids ``[T]`` of a conversation in the model's chat template, ending with the
    assistant's turn opened (``add_generation_prompt``).

    Each message's content goes in as the template renders it (as written, unless the
    template edits it: trims it, drops an earlier turn's reasoning) and is tokenised as
    data (:func:`encode_data`): the template is rendered with a placeholder for each
    content, its own parts are tokenised with special tokens.

    Args:
        messages: ``{"role": ..., "content": str}`` each (``system``, ``user``,
            ``assistant``: whatever roles the template accepts).

    Raises:
        ValueError: the tokenizer has no chat template, the template refuses
            the conversation (its own error, e.g. roles that do not alternate),
            drops a message's content, or edits one so that its own text changes too.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template")
    slotted = [{**m, "content": _slot(i)} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(slotted, add_generation_prompt=True, tokenize=False)
    pieces = _SLOTS.split(rendered)  # template text, slot index, template text, ...
    placed = {int(i) for i in pieces[1::2]}
    if placed != set(range(len(messages))) or _SLOT in "".join(pieces[::2]):
        missing = sorted(set(range(len(messages))) - placed)
        raise ValueError("the chat template does not place every message verbatim in the prompt"
                         + (f" (message {missing[0]} is dropped)" if missing else ""))
    order, texts = [int(i) for i in pieces[1::2]], pieces[::2]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    placed_as = [messages[i]["content"] for i in order]
    if _between(texts, placed_as) != rendered:  # the template edits contents
        placed_as = _as_rendered(tokenizer, messages, texts, order)
        if _between(texts, placed_as) != rendered:  # an edit hangs on another message
            raise ValueError("the chat template edits a message according to another message's text "
                             "(mlx-tier renders each message's text apart from the template's own)")
    ids = list(tokenizer.encode(texts[0], add_special_tokens=False)) if texts[0] else []
    for content, text in zip(placed_as, texts[1:]):
        ids += encode_data(tokenizer, content) if content else []
        ids += list(tokenizer.encode(text, add_special_tokens=False)) if text else []
    return ids


def _between(texts: list[str], contents: list[str]) -> str:
    """The template's own ``texts`` with ``contents`` between them: the prompt as text."""
    return "".join(t + c for t, c in zip(texts, [*contents, ""]))


def _as_rendered(tokenizer, messages: list[dict], texts: list[str], order: list[int]) -> list[str]:
    """Each placed message's content as the chat template renders it, where the template edits
    it (Llama 3's ``| trim``, Qwen3 dropping the ``<think>`` block of earlier assistant turns):
    the conversation is rendered once per message with only that message's content real and
    the others as placeholders, so the text between its neighbours' placeholders is the
    template's own (``texts``, as rendered around placeholders) around that content, with no
    doubt where one ends and the other begins, whatever the content holds.

    Raises:
        ValueError: the template's own text differs with a content (its markup depends on
            it), or an edited message is placed more than once.
    """
    out = []
    for k, i in enumerate(order):
        alone = [{**m, "content": m["content"] if j == i else _slot(j)} for j, m in enumerate(messages)]
        pieces = _SLOTS.split(tokenizer.apply_chat_template(alone, add_generation_prompt=True, tokenize=False))
        segments, others = pieces[::2], [int(x) for x in pieces[1::2]]
        pre, post = texts[k], texts[k + 1]
        seg = segments[k] if len(segments) == len(texts) - 1 else ""
        if order.count(i) > 1 or others != order[:k] + order[k + 1:] \
                or segments[:k] + segments[k + 1:] != texts[:k] + texts[k + 2:] \
                or not (seg.startswith(pre) and seg.endswith(post) and len(seg) >= len(pre) + len(post)):
            raise ValueError(f"the chat template changes message {i}'s text in a way that cannot be told apart "
                             "from the template's own (its markup depends on the text)")
        out.append(seg[len(pre):len(seg) - len(post)])
    return out


# Reasoning formats: "think" (``<think>…</think>`` blocks) and "harmony"
# (GPT-OSS channels). Model types that reason whatever their template says:
REASONING_MODEL_TYPES = {"gpt_oss": "harmony"}


def reasoning_format(tokenizer, model_dir: Path | None = None) -> str | None:
    """How the model marks its reasoning: ``"harmony"``, ``"think"`` or ``None``.

    From the chat template (one that writes ``<|channel|>`` is harmony, one
    that writes ``<think>`` or ``</think>`` is think) and ``config.json``'s
    ``model_type`` (:data:`REASONING_MODEL_TYPES`). ``None``: the model does
    not reason, and its output is taken as it is.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(str(t) for t in template.values())
    template = str(template)
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError, TypeError):
        model_type = None
    if "<|channel|>" in template or REASONING_MODEL_TYPES.get(model_type) == "harmony":
        return "harmony"
    if "<think>" in template or "</think>" in template:
        return "think"
    return None


# Reasoning rule (documented in docs/cli.md), for a model of format "think":
# (1) ``<think>…</think>`` blocks are removed; an unclosed ``<think>`` runs to
# the end of the text. (2) A ``</think>`` without an opening tag (the chat
# template opened it) ends the reasoning: everything before it is reasoning.
# Format "harmony" (GPT-OSS): the text of the last ``final`` channel message
# is the summary; ``analysis`` messages are reasoning.
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)
_HARMONY = re.compile(r"<\|channel\|>(\w+)(?:[^<]*)<\|message\|>(.*?)(?=<\|end\|>|<\|return\|>|<\|start\|>|$)", re.DOTALL)


def strip_reasoning(text: str, fmt: str | None = "think") -> tuple[str, str]:
    """Split generated text into ``(summary, reasoning)`` by the rule above.

    Args:
        fmt: the model's :func:`reasoning_format`; ``None`` takes the whole
            text as the summary (a lone ``</think>`` in it is ordinary text).
            For ``"think"``, harmony channels are recognised too.

    Both parts are stripped of surrounding whitespace; ``reasoning`` is ``""``
    when the text holds none.
    """
    if fmt is None:
        return text.strip(), ""
    if "<|channel|>" in text:
        messages = _HARMONY.findall(text)
        finals = [m for ch, m in messages if ch == "final"]
        reasoning = "\n\n".join(m.strip() for ch, m in messages if ch != "final")
        return (finals[-1].strip() if finals else ""), reasoning
    reasoning = []
    if "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
        head, text = text.split("</think>", 1)
        reasoning.append(head.strip())
    reasoning += [m.strip() for m in _THINK.findall(text)]
    summary = _THINK.sub("", text)
    return summary.strip(), "\n\n".join(r for r in reasoning if r)


# A sentence is complete when it ends with one of these marks, possibly
# followed by closing quotes or brackets.
_SENTENCE_END = re.compile(r"[.!?。！？…‼⁇⁈⁉][\"'”’»」』)\]）】]*\s*$")


CUT_MARK = "…"  # ends a cut text with no sentence ended (trim_to_sentence)


def trim_to_sentence(text: str, language: str = "en") -> str:
    """Drop a trailing unfinished sentence of an output cut by the token limit.

    Sentences are found by ``sentencex`` (Wikimedia's rule-based segmenter,
    ~300 languages via fallbacks; abbreviations such as "e.g.", "Dr.", "U.S."
    and decimal numbers such as "4.81" do not end a sentence; 。！？ do).
    A cut text may stop right after a dot that the next token would have
    continued: ``Costs fell 2.`` of ``2.5``, ``It costs approx.``, ``The U.S.``.
    So a last sentence whose final dot follows a number or an abbreviation
    (:func:`_ambiguous_end`) counts as unfinished: it is dropped, or, when it is
    the only sentence, its dangling dot is. A text with no sentence ended (a heading
    or list items and a cut line) is kept whole, marked cut with ``…`` (a figure or
    word is never shown cut as if it were whole, nor a heading left for a summary).

    Args:
        text: the model's output, cut by the token limit.
        language: ISO 639 code of the text's language (abbreviation lists).

    Returns:
        ``text`` up to the end of its last complete sentence; ``text``
        unchanged when its last sentence is complete; ``text`` (without a dangling
        dot) and ``…`` when no sentence ended.
    """
    import sentencex

    sentences = [s for s in sentencex.segment(language, text) if s.strip()]
    if not sentences or text.rstrip().endswith(("...", CUT_MARK)):  # empty, or its trailing dots say so
        return text
    last = sentences[-1]
    if _SENTENCE_END.search(last) and not _ambiguous_end(last):
        return text
    cut = text.rstrip().rfind(last.strip())
    if len(sentences) >= 2 and cut > 0 and any(_SENTENCE_END.search(s) for s in sentences[:-1]):
        return text[:cut].rstrip()  # the unfinished last one goes (headings and list items before it stay)
    return (_DANGLING_DOT.sub("", text.rstrip()) if _ambiguous_end(last) else text.rstrip()) + CUT_MARK


# Words that end with a dot without ending a sentence (case-insensitive), beyond
# what the number and initials rules of _ambiguous_end catch.
_ABBREVIATIONS = frozenset("""
    approx etc vs cf ca no nos fig figs eq eqs vol p pp ch sec sect ed eds est min max incl excl
    misc dept inc ltd co corp mr mrs ms dr prof st jr sr gen col lt sgt rev mt ft ave al
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
    bzw usw ggf evtl nr ca mme mlle env sr sra
""".split())
_LAST_WORD = re.compile(r"(\S+)\.[\"'”’»」』)\]）】]*\s*$")
_DANGLING_DOT = re.compile(r"\.(?=[\"'”’»」』)\]）】]*$)")


def _ambiguous_end(sentence: str) -> bool:
    """Whether ``sentence`` ends with a dot that need not end it: after a number
    (``2.``, ``4.81.``), initials or a dotted abbreviation (``U.S.``, ``e.g.``,
    ``B.``) or a common abbreviation (``approx.``, ``Dr.``, ``no.``)."""
    m = _LAST_WORD.search(sentence)
    if m is None:
        return False
    word = m.group(1).lstrip("\"'“‘«「『([（【")
    return (word[-1:].isdigit() or "." in word or (len(word) == 1 and word.isalpha())
            or word.lower() in _ABBREVIATIONS)
