"""Requests of the OpenAI API, checked field by field, and errors in OpenAI's JSON shape.

A request becomes a GenRequest (prompt token ids, sampling settings, stops, limits) or an APIError with
the status, type, param and a message that says what was wrong. Unknown fields are errors, not silently
ignored: a client that asks for something the server does not do hears so (llama-server's own fields that
it does not do are named as llama-server's). Also here: llama-server's /tokenize and /detokenize requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..engine.chat_template import RESERVED_NAMES, join_text_parts
from ..engine.sampling import RANDOM_SEED, SamplingParams


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# Fields every OpenAI client may send that change nothing here.
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "stream_options", "prompt_cache_key",
           "safety_identifier", "verbosity"}
# llama-server's fields that clients written for it send: n_predict (its max_tokens) and cache_prompt (its
# prompt cache, which is always on here: true or false, the answer is the same).
LLAMA_FIELDS = {"n_predict", "cache_prompt"}
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "n", "presence_penalty", "frequency_penalty", "repeat_penalty", "logit_bias"} | IGNORED | LLAMA_FIELDS
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                        "modalities", "reasoning_format", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "suffix", "best_of", "audio", "prediction",
               "reasoning_effort", "web_search_options"}
# llama-server's own request fields this server does not do: refused as such (a migrating client hears what
# it asked for is llama-server's), not as unknown.
LLAMA_SERVER_ONLY = {
    "grammar", "json_schema", "id_slot", "samplers", "typical_p", "top_n_sigma", "repeat_last_n", "min_keep",
    "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent", "xtc_probability",
    "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "ignore_eos", "n_probs", "post_sampling_probs", "n_keep", "n_indent",
    "n_cache_reuse", "n_cmpl", "t_max_predict_ms", "return_tokens", "return_progress", "timings_per_token",
    "response_fields", "lora", "reasoning_control", "sse_ping_interval"}
# llama-server's reasoning_format values: taken and ignored (see chat_request).
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
# Names chat_template_kwargs may not set: the variables the server gives the template, and the functions the
# template language has (a client's value there would break the template, answered as the server's 500).
TEMPLATE_NAMES = RESERVED_NAMES

MAX_N = 16
MAX_TOP_LOGPROBS = 20


@dataclass
class GenRequest:
    """One request, ready for the scheduler: n choices of each prompt."""

    prompts: list  # token ids, one list per prompt
    max_tokens: int | None  # None: until the end of turn or the context
    params: SamplingParams
    seed: int | None
    stops: list
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict = field(default_factory=dict)
    response_format: dict | None = None
    stream: bool = False
    include_usage: bool = False
    # chat answers' reasoning put apart in reasoning_content: "harmony" (gpt-oss), "think" (<think> tags; "think-open"
    # when the prompt opened the block), or None (the text as generated)
    reasoning: str | None = None


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body nests its JSON too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _number(body: dict, name: str, default, lo=None, hi=None, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, not {json.dumps(v)}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be finite", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise bad(f"'{name}' must be {bounds}, got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, not {json.dumps(v)}", name)
    return v


def _check_fields(body: dict, allowed: set) -> None:
    for k, v in body.items():
        if k in allowed:
            continue
        if v is None and (k in UNSUPPORTED or k in LLAMA_SERVER_ONLY):
            continue  # (some clients send every field, unset ones as null, as OpenAI allows)
        if k in UNSUPPORTED:
            raise bad(f"'{k}' is not supported by this server", k, code="unsupported_parameter")
        if k in LLAMA_SERVER_ONLY:
            raise bad(f"llama-server's '{k}' is not supported by this server", k, code="unsupported_parameter")
        raise bad(f"unknown field '{k}'", k, code="unknown_parameter")


def _stops(body: dict) -> list:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or len(s) > 4 or not all(isinstance(x, str) and x for x in s):
        raise bad("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    return s


def _max_tokens(body: dict, max_name: str):
    """The most tokens to generate (None: no limit) from max_name, else max_tokens, else llama-server's
    n_predict (-1: no limit)."""
    given = max_name if body.get(max_name) is not None else "max_tokens"
    max_tokens = _number(body, given, None, lo=1, integer=True)
    n_predict = _number(body, "n_predict", None, lo=-1, integer=True)
    if n_predict is None:
        return max_tokens
    if n_predict == 0:  # (llama-server's "read the prompt into the cache only": no answer to give here)
        raise bad("'n_predict' must be -1 (no limit) or >= 1, got 0", "n_predict")
    if n_predict == -1:  # (llama-server's default, which clients send beside max_tokens: not a limit of its own)
        return max_tokens
    limit = n_predict
    if max_tokens is not None and max_tokens != limit:
        raise bad(f"'n_predict' ({n_predict}) and '{given}' ({max_tokens}) disagree: give one of them", "n_predict")
    return limit


def _common(body: dict, n_vocab: int, max_name: str = "max_tokens") -> dict:
    max_tokens = _max_tokens(body, max_name)
    _bool(body, "cache_prompt", True)  # checked, then ignored: the prefix cache is always on
    d = SamplingParams()
    params = SamplingParams(
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        top_k=_number(body, "top_k", 0, 0, n_vocab, integer=True),
        min_p=float(_number(body, "min_p", 0.0, 0.0, 1.0)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        repeat_penalty=float(_number(body, "repeat_penalty", 1.0, 0.0, 10.0)),
        repeat_last_n=d.repeat_last_n,
    )
    if params.repeat_penalty <= 0:  # (it divides the logits)
        raise bad(f"'repeat_penalty' must be in (0, 10], got {params.repeat_penalty:g}", "repeat_penalty")
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise bad("'logit_bias' must be an object of token id -> bias", "logit_bias")
    logit_bias = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except ValueError:
            raise bad(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= tok < n_vocab or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' entry {k!r}: token id in [0, {n_vocab}) and bias in [-100, 100]", "logit_bias")
        logit_bias[tok] = float(v)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        for k in opts:
            if k not in ("include_usage", "include_obfuscation"):  # (obfuscation: OpenAI's padding; none here)
                raise bad(f"unknown field 'stream_options.{k}'", "stream_options", code="unknown_parameter")
        for k in ("include_usage", "include_obfuscation"):
            if opts.get(k) is not None and not isinstance(opts[k], bool):
                raise bad(f"'stream_options.{k}' must be a boolean, not {json.dumps(opts[k])}", f"stream_options.{k}")
    include_usage = bool((opts or {}).get("include_usage"))
    return dict(max_tokens=max_tokens, params=params, seed=seed, stops=_stops(body),
                n=_number(body, "n", 1, 1, MAX_N, integer=True), logit_bias=logit_bias,
                stream=stream, include_usage=include_usage)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        text = join_text_parts(c)
        if text is None:
            raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        return text
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def chat_messages(body: dict) -> list:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role must be system, developer, user or assistant, not {json.dumps(role)}",
                      f"messages[{i}].role")
        out.append({"role": role, "content": _content(m, i)})
    return out


def response_format(body: dict):
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'response_format.type' must be text, json_object or json_schema", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad("'response_format.json_schema' must be an object with a 'schema' object",
                      "response_format")
    return rf


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs (llama-server's): extra variables for the chat template (Qwen3's enable_thinking)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object of variables for the chat template",
                  "chat_template_kwargs")
    taken = sorted(TEMPLATE_NAMES & kw.keys())
    if taken:
        raise bad(f"'chat_template_kwargs' may not set '{taken[0]}': the template has its own", "chat_template_kwargs")
    return kw


def chat_request(body: dict, n_vocab: int) -> tuple:
    """(messages, chat template variables, fields for GenRequest without prompts)."""
    _check_fields(body, CHAT_FIELDS)
    messages = chat_messages(body)
    if body.get("modalities") not in (None, ["text"]):
        raise bad("'modalities' must be [\"text\"]: this server answers with text only", "modalities",
                  code="unsupported_parameter")
    # llama-server's reasoning_format: "none" leaves the reasoning in the content as generated; the others put
    # it in reasoning_content, as its default does (gpt-oss's analysis channel, <think> blocks: app.py).
    if body.get("reasoning_format") not in (None, *REASONING_FORMATS):
        raise bad(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    c = _common(body, n_vocab, "max_completion_tokens")
    c["logprobs"] = _bool(body, "logprobs")
    c["top_logprobs"] = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    if c["top_logprobs"] and not c["logprobs"]:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    c["response_format"] = response_format(body)
    return messages, template_kwargs(body), c


def completion_request(body: dict, n_vocab: int) -> tuple:
    """(prompts: list of str or token lists, fields for GenRequest without prompts)."""
    _check_fields(body, COMPLETION_FIELDS)
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = p
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and
                                           all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        prompts = p
    else:
        raise bad("'prompt' must be a string, a list of strings, or token ids", "prompt")
    for q in prompts:
        if not isinstance(q, str) and not all(0 <= t < n_vocab for t in q):
            raise bad(f"'prompt' token ids must be in [0, {n_vocab})", "prompt")
    c = _common(body, n_vocab)
    lp = _number(body, "logprobs", None, 0, 5, integer=True)
    c["logprobs"] = lp is not None
    c["top_logprobs"] = lp or 0
    if _bool(body, "echo"):
        raise bad("'echo' is not supported by this server", "echo", code="unsupported_parameter")
    return prompts, c


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


def embedding_request(body: dict, n_vocab: int) -> tuple:
    """POST /v1/embeddings: (inputs: a list of str or token lists, encoding_format "float" or "base64").
    OpenAI's client asks for base64 unless told otherwise."""
    _check_fields(body, {"model", "input", "encoding_format", "dimensions", "user"})
    p = body.get("input")
    if isinstance(p, str):
        inputs = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        inputs = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in p):
        inputs = p
    else:
        raise bad("'input' must be a string, a list of strings, token ids, or a list of token id lists", "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise bad(f"'input' holds {len(inputs)} inputs; a request takes at most {MAX_EMBEDDING_INPUTS}", "input")
    for q in inputs:
        if isinstance(q, str) and not q:
            raise bad("'input' holds an empty string: nothing to embed", "input")
        if not isinstance(q, str) and not all(0 <= t < n_vocab for t in q):
            raise bad(f"'input' token ids must be in [0, {n_vocab})", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions") is not None:
        raise bad("'dimensions' is not supported: the embeddings have the model's width", "dimensions",
                  code="unsupported_parameter")
    return inputs, fmt


def tokenize_request(body: dict) -> tuple:
    """llama-server's POST /tokenize: (content, add_special, parse_special, with_pieces), its defaults."""
    _check_fields(body, {"model", "content", "add_special", "parse_special", "with_pieces"})
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("'content' must be the text to tokenize (a string)", "content")
    return (content, _bool(body, "add_special", False), _bool(body, "parse_special", True),
            _bool(body, "with_pieces", False))


def detokenize_request(body: dict, n_vocab: int) -> list:
    """llama-server's POST /detokenize: the token ids."""
    _check_fields(body, {"model", "tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab
                                            for t in ids):
        raise bad(f"'tokens' must be a list of token ids in [0, {n_vocab})", "tokens")
    return ids
