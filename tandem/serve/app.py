"""The FastAPI application: routes, request parsing and error handling.

`create_app(llm, ...)` wires an `LLM`'s engine to an `EngineRunner` (started and stopped with
the app's lifespan). Routes: `GET /health`, `GET /metrics`, `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions` (JSON or SSE streaming). Every error is
an OpenAI error object (see `errors.py`); bodies are parsed by hand so that malformed JSON and
invalid fields both come back as 400 naming the field, as OpenAI does (never FastAPI's 422).

With an API key (`ServeConfig.api_key`) every /v1 route wants `Authorization: Bearer <key>`
(401 otherwise); /health and /metrics stay open, for load balancers and scrapers. The limits of
`ServeConfig` are checked before a request reaches the engine, except the queue's: a request
waits for an engine row at most `queue_timeout_s` (503 after, and it leaves the engine), and
at most `max_queued_requests` requests wait at once (429 beyond).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import jinja2
import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tandem.engine.output import RequestOutput
from tandem.grammars.spec import json_depth
from tandem.llm import LLM
from tandem.serve import responses, tools
from tandem.serve.config import ServeConfig
from tandem.serve.errors import APIError, from_exception, from_validation, invalid
from tandem.serve.metrics import Metrics
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest, Constraint, SamplingRequest
from tandem.serve.runner import EngineRunner, Generation, Job

DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there
Body = TypeVar("Body", bound=SamplingRequest)


class Server:
    """The state the routes share: the model, its engine thread, the metrics and the limits."""

    def __init__(self, llm: LLM, model_name: str, draft: str | None, config: ServeConfig) -> None:
        self.llm, self.model_name, self.draft, self.config = llm, model_name, draft, config
        self.metrics = Metrics()
        self.runner = EngineRunner(llm.engine, self.metrics)
        self.created = int(time.time())
        self.token_text = functools.lru_cache(maxsize=None)(lambda token_id: llm.tokenizer.decode([token_id]))
        self.queued = 0  # HTTP requests waiting for an engine row (touched on the event loop only)

    async def authorize(self, request: Request) -> None:
        """401 unless the request carries the API key (when the server has one), compared in constant time."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(
                401, "missing API key: send it as the header `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    async def parse(self, request: Request, body_type: type[Body]) -> Body:
        """The request body as `body_type`; 413 past `max_body_bytes`, 400 for malformed JSON or invalid
        fields, 404 for another model."""
        limit = self.config.max_body_bytes
        too_large = APIError(
            413,
            f"the request body is larger than the server's limit max_body_bytes = {limit}",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():  # a body without Content-Length is counted as it arrives
            raw += chunk
            if len(raw) > limit:
                raise too_large
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise invalid(f"request body is not valid JSON: {error}", code="invalid_json") from None
        except RecursionError:
            raise invalid("request body is nested too deeply to parse", code="invalid_json") from None
        try:
            body = body_type.model_validate(data)
        except pydantic.ValidationError as error:
            raise from_validation(error) from None
        if body.model != self.model_name:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )
        return body

    def context(self, object_prefix: str) -> responses.ResponseContext:
        return responses.ResponseContext(object_prefix, self.model_name, self.draft, self.llm.engine.k, self.token_text)

    def check_constraint(self, constraint: Constraint | None, tool_list: list[tools.Tool]) -> None:
        """400 for a JSON schema of the request (its constraint's, a tool's parameters) past
        `max_schema_depth` or `max_schema_bytes`. A grammar is parsed once, where the engine builds it (:meth:`start`
        names the request's field in its error)."""
        schemas = [(constraint.value, constraint.param)] if constraint and constraint.kind == "json_schema" else []
        schemas += [(tool.function.parameters, f"tools.{i}.function.parameters") for i, tool in enumerate(tool_list)]
        for schema, param in schemas:
            depth, limit = json_depth(schema), self.config.max_schema_depth
            if depth > limit:
                raise invalid(
                    f"{param}: the JSON schema nests objects and arrays {depth} levels deep, past the server's "
                    f"limit max_schema_depth = {limit}",
                    param=param,
                    code="schema_too_deep",
                )
            size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
            if size > self.config.max_schema_bytes:
                raise invalid(
                    f"{param}: the JSON schema is {size} bytes, past the server's limit max_schema_bytes = "
                    f"{self.config.max_schema_bytes}",
                    param=param,
                    code="schema_too_large",
                )

    def jobs(
        self, body: SamplingRequest, prompt: list[int], constraint: Constraint | None, prompt_param: str
    ) -> list[Job]:
        """The engine requests of one prompt: one per choice, max_tokens defaulting to the room left
        (at most `max_new_tokens`)."""
        engine, limit = self.llm.engine, self.config.max_new_tokens
        room = engine.config.max_model_len - len(prompt) - engine.k - 1
        budget = body.token_budget()
        if budget is not None and limit is not None and budget > limit:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise invalid(
                f"{param} = {budget} is past the server's limit max_new_tokens = {limit}",
                param=param,
                code="max_tokens_exceeded",
            )
        if budget is not None and 1 <= room < budget:
            raise invalid(
                f"prompt has {len(prompt)} tokens and {budget} new tokens were asked for, but the context "
                f"is {engine.config.max_model_len} tokens ({engine.k + 1} reserved for speculation): "
                f"at most {room} new tokens fit",
                param=prompt_param,
                code="context_length_exceeded",
            )
        budget = budget or max(min(room, limit or room), 1)
        try:
            return [(prompt, params) for params in body.sampling_params(budget, constraint)]
        except ValueError as error:
            raise invalid(str(error), code="invalid_value") from None

    async def start(self, jobs: list[Job], constraint: Constraint | None, prompt_param: str) -> Generation:
        """Submit the jobs and wait until one has its engine row; their errors become APIErrors, and so
        do a full queue (429) and a wait past `queue_timeout_s` (503, the jobs leave the engine)."""
        limit, timeout = self.config.max_queued_requests, self.config.queue_timeout_s
        if self.queued >= limit:
            raise APIError(
                429,
                f"the server is busy: {self.queued} requests wait for the engine, its limit max_queued_requests = "
                f"{limit}; retry later",
                code="queue_full",
            )
        generation = self.runner.submit(jobs)
        self.queued += 1
        try:
            await asyncio.wait_for(generation.admitted(), timeout)
        except BaseException as error:
            generation.abort()  # a no-op for a rejected generation: nothing of it is in the engine
            if isinstance(error, TimeoutError):
                raise APIError(
                    503,
                    f"the request waited for the engine past the server's limit queue_timeout_s = {timeout:g}; "
                    "retry later",
                    code="queue_timeout",
                ) from None
            if isinstance(error, Exception):
                schema_param = constraint.param if constraint else "response_format"
                grammar = constraint is not None and constraint.kind == "grammar"
                raise from_exception(
                    error, schema_param=schema_param, prompt_param=prompt_param, grammar=grammar
                ) from None
            raise  # cancelled: the client left
        finally:
            self.queued -= 1
        return generation


def create_app(llm: LLM, model_name: str, draft: str | None, config: ServeConfig | None = None) -> FastAPI:
    """The OpenAI-compatible app over `llm` (whose engine only the app's runner thread may touch
    from now on), serving it as `model_name` with `config`'s key and limits (`config`'s engine settings
    are `build_app`'s); `draft` names the draft in responses."""
    server = Server(llm, model_name, draft, config or ServeConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.runner.start()
        yield
        server.runner.stop()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.server = server

    def respond(error: APIError) -> JSONResponse:
        server.metrics.record_rejected(error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return respond(error)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return respond(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return respond(APIError(500, f"internal error: {type(error).__name__}: {error}", type="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread runs, else 503."""
        alive = server.runner.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = server.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.authorize)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "tandem",
            "max_model_len": llm.engine.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await server.parse(request, ChatCompletionRequest)
        server.check_constraint(body.constraint(), body.tools or [])
        plan = tools.plan(body)
        try:
            prompt = llm.chat_prompt(
                [m.template_dict() for m in body.messages],
                [tool.model_dump(exclude_none=True) for tool in plan.tools] or None,
            )
        except jinja2.TemplateError as error:
            raise invalid(f"the chat template cannot render these messages: {error}", param="messages") from None
        generation = await server.start(
            server.jobs(body, prompt, plan.constraint, "messages"), plan.constraint, "messages"
        )
        ctx = server.context("chatcmpl")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _event_stream(_chat_stream(generation, ctx, len(prompt), plan, include_usage))
        outputs = await _collect(generation, request)
        return JSONResponse(responses.chat_completion(ctx, len(prompt), outputs, plan.tools))

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await server.parse(request, CompletionRequest)
        constraint = body.constraint()
        server.check_constraint(constraint, [])
        prompts = [llm.encode(prompt) for prompt in body.prompts()]
        jobs = [job for prompt in prompts for job in server.jobs(body, prompt, constraint, "prompt")]
        generation = await server.start(jobs, constraint, "prompt")
        ctx, prompt_tokens = server.context("cmpl"), sum(len(prompt) for prompt in prompts)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _event_stream(_completion_stream(generation, ctx, prompt_tokens, include_usage))
        outputs = await _collect(generation, request)
        return JSONResponse(responses.completion(ctx, prompt_tokens, outputs))

    app.include_router(v1)
    return app


async def _collect(generation: Generation, request: Request) -> list[RequestOutput]:
    """Every choice's final output, in choice order; aborts the generation if the client leaves."""
    outputs: list[RequestOutput | None] = [None] * len(generation.jobs)
    watcher = asyncio.create_task(_abort_on_disconnect(request, generation))
    try:
        async for event in generation.events():
            if event.output is not None:
                outputs[event.index] = event.output
    finally:
        watcher.cancel()
        generation.abort()
    if any(output.finish_reason == "abort" for output in outputs):
        raise APIError(499, "client closed the request", code="client_closed_request")
    return outputs


async def _abort_on_disconnect(request: Request, generation: Generation) -> None:
    while not generation.finished:
        if await request.is_disconnected():
            generation.abort()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def _event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_stream(
    generation: Generation,
    ctx: responses.ResponseContext,
    prompt_tokens: int,
    plan: tools.ToolPlan,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE chunks of a chat completion. Reasoning streams as it comes; so does the answer, except
    when it may be a tool call: then it is held until it starts a call, whose arguments then stream
    (`tools.CallStream`, where `plan.stream_calls`), or sent whole (as `tool_calls` or `content`) at the end."""
    outputs: list[RequestOutput] = []
    names = [tool.function.name for tool in plan.tools]
    calls = [tools.CallStream(names) if plan.stream_calls else None for _ in generation.jobs]
    try:
        for index in range(len(generation.jobs)):
            yield responses.sse(responses.chat_chunk(ctx, index, {"role": "assistant", "content": ""}))
        async for event in generation.events():
            call = calls[event.index]
            if event.delta is not None:
                delta = responses.reasoning_fields(event.delta.reasoning)
                if event.delta.text and not plan.tools:
                    delta["content"] = event.delta.text
                elif event.delta.text and call is not None and (entries := call.feed(event.delta.text)):
                    delta["tool_calls"] = entries
                if delta or event.delta.logprobs:
                    yield responses.sse(responses.chat_chunk(ctx, event.index, delta, logprobs=event.delta.logprobs))
                continue
            outputs.append(event.output)
            delta, finish_reason = {}, event.output.finish_reason
            if call is not None and call.is_call:
                complete = finish_reason == "stop"
                if entries := call.finish(complete):
                    delta = {"tool_calls": entries}
                finish_reason = "tool_calls" if complete else finish_reason
            elif plan.tools:
                message, finish_reason = responses.chat_message(event.output, plan.tools)
                whole = message.get("tool_calls")
                delta = {"tool_calls": [{"index": 0, **whole[0]}]} if whole else {"content": message["content"]}
            yield responses.sse(responses.chat_chunk(ctx, event.index, delta, finish_reason))
        if include_usage:
            yield responses.sse(responses.usage_chunk(ctx, "chat.completion.chunk", prompt_tokens, outputs))
        yield responses.sse("[DONE]")
    except Exception as error:  # the engine failed mid-stream: the status line is gone, say it in-band
        yield responses.sse(from_exception(error, schema_param="response_format", prompt_param="messages").body())
    finally:
        generation.abort()


async def _completion_stream(
    generation: Generation, ctx: responses.ResponseContext, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    """SSE chunks of a text completion: each choice's answer (and reasoning) as it is generated."""
    outputs: list[RequestOutput] = []
    offsets = [0] * len(generation.jobs)  # text of each choice's tokens so far (legacy logprobs' text_offset)
    try:
        async for event in generation.events():
            if event.delta is not None:
                logprobs = responses.completion_logprobs(ctx, event.delta.logprobs, offsets[event.index])
                if logprobs is not None:
                    offsets[event.index] += sum(map(len, logprobs["tokens"]))
                choice = responses.completion_choice(
                    event.index, event.delta.text, event.delta.reasoning, None, logprobs
                )
            else:
                outputs.append(event.output)
                choice = responses.completion_choice(event.index, "", "", event.output.finish_reason)
            yield responses.sse({**ctx.envelope("text_completion"), "choices": [choice]})
        if include_usage:
            yield responses.sse(responses.usage_chunk(ctx, "text_completion", prompt_tokens, outputs))
        yield responses.sse("[DONE]")
    except Exception as error:
        yield responses.sse(from_exception(error, schema_param="response_format", prompt_param="prompt").body())
    finally:
        generation.abort()
