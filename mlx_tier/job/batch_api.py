"""OpenAI Batch API files: request lines in, run as written; response and error lines out.

A request line is ``{"custom_id": str, "method": "POST", "url": URL, "body": {...}}``
(the Batch API's input format, which vLLM's ``run_batch`` also reads), ``URL``
one of :data:`ENDPOINTS`. The file as a whole is checked before any work, as the
Batch API checks an upload: a line that is not such an object, a repeated
``custom_id``, another method or an unknown ``url`` refuses the file
(:class:`~mlx_tier.errors.InputError` naming the line). A body that cannot run as
written fails that request alone (:class:`~mlx_tier.errors.RequestError`: its line
goes to ``errors.jsonl``, the other requests run).

What a body may hold; anything else fails the request, never silently ignored:

- run as the API runs it: ``messages`` (``system``/``developer``/``user``/``assistant``
  turns with text content) or ``prompt``; ``max_completion_tokens``/``max_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``n``; vLLM's extra sampling
  parameters ``top_k``, ``min_p``, ``repetition_penalty``;
- bookkeeping that changes no token (:data:`BOOKKEEPING`): ``model`` names a cloud
  model, the local one answers and each response names it;
- any other parameter only at a value that changes nothing: null, false, 0 (not
  where 0 asks for something: :data:`ZERO_ASKS`), an empty string, list or
  object, or the API's own default (:data:`NO_OP`).

Defaults are the API's (temperature 1, top_p 1, n 1), except the token limit: a
request that sets none gets the job's ``max_tokens``, at most what the context leaves.

Response lines follow the Batch API's output format (``id``, ``custom_id``,
``response`` with ``status_code``, ``request_id`` and ``body``, ``error``); the
body is a chat completion (``/v1/chat/completions``) or a text completion
(``/v1/completions``) object as the API returns it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from mlx_tier.errors import InputError, RequestError
from mlx_tier.job.doc_text import surrogate_at
from mlx_tier.job.prompts import build_chat_prompt
from mlx_tier.job.sampling import WHOLE, Sampling

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
LINE_KEYS = ("custom_id", "method", "url", "body")

# Body parameters run as written, by endpoint.
_COMMON = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop", "n", "top_k", "min_p",
                     "repetition_penalty"})
RUN = {CHAT: _COMMON | {"messages", "max_completion_tokens"}, COMPLETIONS: _COMMON | {"prompt"}}
# Parameters that change no generated token: accepted with any value.
BOOKKEEPING = frozenset({"model", "user", "metadata", "store", "service_tier", "safety_identifier",
                         "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                         "stream_options", "parallel_tool_calls"})
# The API's own defaults of parameters mlx-tier does not implement (beyond null, false, 0
# and empty values): at these values they change nothing.
NO_OP = {"best_of": (1,), "response_format": ({"type": "text"},), "tool_choice": ("none", "auto"),
         "modalities": (["text"],)}
# Parameters whose 0 asks for something (not implemented): the legacy completions' `logprobs`
# (the sampled token's log probability) and vLLM's `prompt_logprobs` (each prompt token's).
ZERO_ASKS = {"logprobs", "prompt_logprobs"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_CHOICES = 128  # the API's limit on n


def is_request(obj: object) -> bool:
    """Whether a parsed JSONL line is meant as a batch request (it has a ``url``, ``method`` or ``body``)."""
    return isinstance(obj, dict) and any(k in obj for k in ("url", "method", "body"))


@dataclass(frozen=True)
class Plan:
    """What a valid request asks for.

    Attributes:
        max_tokens: most tokens per choice; ``None``: not set (the job's applies).
        n: choices to generate, each its own sequence in the batch.
        sampling: temperature, top_p, seed, stop... (choice ``i`` gets ``stream=i``).
        messages: ``/v1/chat/completions``: ``{"role", "content": str}`` each.
        prompt: ``/v1/completions``: the text, or token ids.
    """

    max_tokens: int | None
    n: int
    sampling: Sampling
    messages: tuple[dict, ...] | None = None
    prompt: str | tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class BatchRequest:
    """One line of a batch request file.

    Attributes:
        custom_id: the caller's id, echoed in its output line.
        url: one of :data:`ENDPOINTS`.
        body: the request body as given.
        line: its line number in the file (1-based).
        plan: what it asks for; ``None`` when it cannot run as written.
        problem: why it cannot run (its ``errors.jsonl`` line); ``None`` when it can.
    """

    custom_id: str
    url: str
    body: dict
    line: int
    plan: Plan | None
    problem: RequestError | None

    @property
    def text(self) -> str:
        """Its text (message contents, or the prompt), to size batches; ``""`` for token ids."""
        if self.plan is None:
            return ""
        if self.plan.messages is not None:
            return "\n".join(m["content"] for m in self.plan.messages)
        return self.plan.prompt if isinstance(self.plan.prompt, str) else ""


def read_requests(lines: list[tuple[int, object]], where: str) -> list[BatchRequest]:
    """The requests of a batch request file, checked as a whole before any work.

    Args:
        lines: ``(line number, parsed JSON)`` of each non-blank line.
        where: the file, as errors name it (``FILE:LINE: ...``).

    Raises:
        InputError: a line is not a request object (or holds another key), its
            ``custom_id`` is not a non-empty string or repeats an earlier one, its
            method is not POST, its ``url`` is not one of :data:`ENDPOINTS`, its
            body is not an object.
    """
    requests, seen = [], {}
    for n, obj in lines:
        req = _request(obj, n, f"{where}:{n}")
        if req.custom_id in seen:
            raise InputError(f"{where}:{n}: duplicate custom_id {req.custom_id!r} (first on line {seen[req.custom_id]})")
        seen[req.custom_id] = n
        requests.append(req)
    return requests


def _request(obj: object, n: int, where: str) -> BatchRequest:
    """One line's request; its body checked (:func:`plan`), a body's problem kept, not raised."""
    if not isinstance(obj, dict) or set(obj) - set(LINE_KEYS):
        extra = sorted(set(obj) - set(LINE_KEYS)) if isinstance(obj, dict) else []
        raise InputError(f'{where}: a batch request line is an object with "custom_id", "method", "url" and '
                         f'"body"' + (f' only (not "{extra[0]}")' if extra else ""))
    for key in LINE_KEYS:
        if key not in obj:
            raise InputError(f'{where}: the request has no "{key}"')
    custom_id, method, url, body = (obj[k] for k in LINE_KEYS)
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(f'{where}: "custom_id" must be a non-empty string')
    if (bad := _lone_surrogate(custom_id)) is not None:
        raise InputError(f'{where}: "custom_id" is not valid Unicode (a lone surrogate, {bad!r})')
    if method != "POST":
        raise InputError(f'{where}: "method" must be "POST", got {method!r}')
    if url not in ENDPOINTS:
        raise InputError(f'{where}: unknown "url" {url!r}; mlx-tier runs {" and ".join(ENDPOINTS)}')
    if not isinstance(body, dict):
        raise InputError(f'{where}: "body" must be an object')
    try:
        return BatchRequest(custom_id, url, body, n, plan(url, body), None)
    except RequestError as e:
        return BatchRequest(custom_id, url, body, n, None, e)


def plan(url: str, body: dict) -> Plan:
    """What a request body asks for (module doc: what it may hold).

    Raises:
        RequestError: a parameter it cannot run as written (``field`` names it).
    """
    for key, value in body.items():
        if key not in RUN[url] and key not in BOOKKEEPING and not _changes_nothing(key, value, url):
            raise RequestError(f"unsupported parameter `{key}` (mlx-tier does not implement it); remove it "
                               "or set it to its default", key, "unsupported_parameter")
    for key, value in body.items():
        if (bad := _lone_surrogate(value)) is not None:  # JSON's "\ud800" escape: no tokenizer encodes it
            raise RequestError(f"`{key}` holds a lone surrogate ({bad!r}): not valid Unicode", key)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return Plan(
        max_tokens=_integer(body, limit, 1, None),
        n=_integer(body, "n", 1, MAX_CHOICES) or 1,
        sampling=_sampling(body),
        messages=chat_messages(body) if url == CHAT else None,
        prompt=completion_prompt(body) if url == COMPLETIONS else None,
    )


def _lone_surrogate(value: object) -> str | None:
    """The first lone surrogate in a JSON value's strings (keys included), ``None`` without."""
    if isinstance(value, str):
        return None if (k := surrogate_at(value)) is None else value[k]
    items = [*value, *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else []
    return next((bad for v in items if (bad := _lone_surrogate(v)) is not None), None)


def _changes_nothing(key: str, value: object, url: str | None = None) -> bool:
    """Whether an unimplemented parameter's value leaves the answer as it is (module doc); a
    chat request's ``logprobs`` is a flag, whose 0 is false."""
    if key in ZERO_ASKS and value == 0 and value is not False and not (key == "logprobs" and url == CHAT):
        return False
    return value is None or value is False or value in (0, "", [], {}) or any(value == v for v in NO_OP.get(key, ()))


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"`{key}` must be a number", key, "invalid_type")
    if not low <= value <= high:
        raise RequestError(f"`{key}` must be between {low:g} and {high:g}, got {value}", key, "invalid_value")
    return float(value)


def _integer(body: dict, key: str, low: int, high: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"`{key}` must be an integer", key, "invalid_type")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"`{key}` must be {bound}, got {value}", key, "invalid_value")
    return value


def _sampling(body: dict) -> Sampling:
    """The body's sampling settings, the API's defaults for those it leaves out."""
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    top_k = _integer(body, "top_k", -1, None) or 0
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    penalty = _number(body, "repetition_penalty", 0, float("inf"))
    if penalty == 0:
        raise RequestError("`repetition_penalty` must be more than 0", "repetition_penalty", "invalid_value")
    return Sampling(
        temperature=0.0 if top_p == 0 else (1.0 if temperature is None else temperature),  # top_p 0: the top token
        top_p=1.0 if top_p is None else top_p, top_k=max(0, top_k), min_p=_number(body, "min_p", 0, 1) or 0.0,
        seed=seed, repetition_penalty=penalty or 1.0, repetition_context=WHOLE, stop=_stop(body.get("stop")),
    )


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("`stop` must be a non-empty string or a list of them", "stop", "invalid_type")
    return tuple(stops)


def chat_messages(body: dict) -> tuple[dict, ...]:
    """A chat body's ``messages`` as ``{"role", "content": str}`` (``developer`` as
    ``system``; text parts of a content list joined by newlines).

    Raises:
        RequestError: missing or empty, a role other than :data:`ROLES`, content
            that is not text, or another message field in use (``name``, ``tool_calls``...).
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list", "messages",
                           "missing_required_parameter" if messages is None else "invalid_type")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _message(m: object, where: str) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise RequestError(f"`{where}` must be an object with a `role`", where, "invalid_type")
    if m["role"] not in ROLES:
        raise RequestError(f"`{where}.role` {m['role']!r} is not supported (mlx-tier runs "
                           f"{', '.join(ROLES)} messages)", f"{where}.role", "unsupported_value")
    for key, value in m.items():
        if key not in ("role", "content") and not _changes_nothing(key, value):
            raise RequestError(f"`{where}.{key}` is not supported", f"{where}.{key}", "unsupported_parameter")
    return {"role": ROLES[m["role"]], "content": _content(m.get("content"), f"{where}.content")}


def _content(content: object, where: str) -> str:
    """A message's text: a string, or the text parts of a list joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"`{where}` must be a string or a list of text parts", where, "invalid_type")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise RequestError(f"`{where}` holds a {kind or 'malformed'} part; mlx-tier runs text parts only",
                               where, "unsupported_value")
        texts.append(part["text"])
    return "\n".join(texts)


def completion_prompt(body: dict) -> str | tuple[int, ...]:
    """A completions body's one ``prompt``: text, or token ids (a list of one of either).

    Raises:
        RequestError: missing, several prompts, or not text or token ids.
    """
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("`prompt` is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise RequestError("several prompts in one request are not supported: give each its own line",
                               "prompt", "unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return tuple(prompt)
    raise RequestError("`prompt` must be a string or a list of token ids", "prompt", "invalid_type")


def prompt_tokens(tokenizer, request: BatchRequest, vocab_size: int | None = None) -> list[int]:
    """The request's prompt as token ids ``[T]``: chat messages in the model's chat template
    (their content as data, :func:`~mlx_tier.job.prompts.build_chat_prompt`); a completions
    prompt as the tokenizer encodes it (special-token strings parsed, as the API's servers
    do: a completions prompt may be a hand-rendered template), or as given.

    Raises:
        RequestError: the request's own problem, no chat template, a template that refuses
            the conversation, an empty prompt, a token id outside the vocabulary.
    """
    if request.problem is not None:
        raise request.problem
    p = request.plan
    if p.messages is not None:
        try:
            return build_chat_prompt(tokenizer, list(p.messages))
        except Exception as e:  # noqa: BLE001 - the template's own errors (jinja's TemplateError...)
            raise RequestError(f"the model's chat template refuses the messages: {e}", "messages") from None
    ids = list(tokenizer.encode(p.prompt)) if isinstance(p.prompt, str) else list(p.prompt)
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise RequestError(f"token id {max(ids)} is outside the model's vocabulary of {vocab_size}", "prompt")
    return ids


def probe_prompts(tokenizer, requests: list[BatchRequest], most: int = 16, start: int = 16) -> list[list[int]]:
    """Prompts whose shared prefix the scheduler prefills once and copies into each
    sequence (a system prompt many requests share): of the first ``most`` requests that
    can run, those of the largest group that begin alike (their first ``start`` tokens),
    first group on ties. Fewer than two: ``[]``, nothing worth sharing."""
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for request in requests:
        if sum(map(len, groups.values())) == most:
            break
        try:
            ids = prompt_tokens(tokenizer, request)
        except RequestError:
            continue
        groups.setdefault(tuple(ids[:start]), []).append(ids)
    largest = max(groups.values(), key=len, default=[])
    return largest if len(largest) >= 2 else []


@dataclass(frozen=True)
class Choice:
    """One generated choice of a request.

    Attributes:
        text: the answer (for chat, outside any reasoning).
        finish_reason: ``stop`` (a stop token or string) or ``length`` (the token limit).
        tokens: tokens generated, a final stop token included (the API's count).
        stop_reason: what stopped it (a token id or a stop string), vLLM's field.
        reasoning: a reasoning model's thinking (chat: ``message.reasoning_content``).
    """

    text: str
    finish_reason: str
    tokens: int
    stop_reason: int | str | None = None
    reasoning: str = ""


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def response_body(request: BatchRequest, choices: list[Choice], prompt_tokens: int, model: str,
                  created: int) -> dict:
    """The API's response object: a chat completion or a text completion.

    Args:
        choices: in index order.
        prompt_tokens: tokens of the prompt (``usage.prompt_tokens``).
        model: the local model that answered.
        created: Unix seconds.
    """
    chat = request.url == CHAT
    made = [_chat_choice(i, c) if chat else _text_choice(i, c) for i, c in enumerate(choices)]
    completion = sum(c.tokens for c in choices)
    return {"id": _new_id("chatcmpl-" if chat else "cmpl-"), "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": made,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


def _chat_choice(i: int, c: Choice) -> dict:
    message = {"role": "assistant", "content": c.text} | ({"reasoning_content": c.reasoning} if c.reasoning else {})
    return {"index": i, "message": message, "logprobs": None, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def _text_choice(i: int, c: Choice) -> dict:
    return {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def output_line(custom_id: str, body: dict) -> dict:
    """A line of ``output.jsonl``: the Batch API's request output object for a success."""
    return {"id": _new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _new_id("req_"), "body": body}, "error": None}


SERVER_ERROR = "server_error"


def error_line(custom_id: str, message: str, code: str | None, param: str | None, line: int | None) -> dict:
    """A line of ``errors.jsonl``: the request's HTTP-style status (400 for a request that
    cannot run as written, 500 when generating failed: ``code`` :data:`SERVER_ERROR`),
    the API's error body, and ``error`` with ``code``, ``message``, ``param`` and ``line``
    (the fields of the Batch API's errors, as vLLM fills ``error``)."""
    code = code or SERVER_ERROR
    server = code == SERVER_ERROR
    error = {"message": message, "type": "server_error" if server else "invalid_request_error", "param": param,
             "code": code}
    return {"id": _new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 500 if server else 400, "request_id": _new_id("req_"),
                         "body": {"error": error}},
            "error": {"code": code, "message": message, "param": param, "line": line}}
