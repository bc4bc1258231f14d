"""Client libraries people use, against a real `augury serve --model demo` (SmolLM2-135M-Instruct with its
EAGLE-3 head, speculation on as served): langchain-openai, pydantic-ai and the OpenAI Agents SDK, each in its
structured-output modes, forced tool calls, a tool round trip and streaming. The official `openai` client has
its own files (test_server_api.py, test_server_structured.py).

A 135M model rarely calls a tool unasked, so tool calls are forced (tool_choice "required" or named), which
augury enforces with a grammar. Every request body a library sends is recorded on its HTTP client, so each
test also checks that the library used the mode it was asked for (response_format, tools, tool_choice, the
tool messages of a round trip) and that augury ignored none of its fields (X-Augury-Ignored-Fields).
Each library's Responses API mode (/v1/responses) is driven too: text, and with the Agents SDK (whose
default it is) a tool round trip through previous_response_id, whole and streamed.
Skipped only when the demo model cannot be downloaded."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from augury import demo
from augury.server.fields import IGNORED_HEADER
from helpers_server import ServerProcess, serve

PROMPT_CITY = 'Name a city in France. Answer in JSON like {"name": "...", "country": "..."}.'
PROMPT_WEATHER = "What is the weather in Paris?"
PROMPT_TEXT = "Tell me about Paris."
WEATHER_REPORT = "It is sunny and 21 degrees in {city}."


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(description="the city's name")
    country: str = Field(description="the country the city is in")


def weather(city: str) -> str:
    return WEATHER_REPORT.format(city=city)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    try:
        demo.ensure_demo_target()
    except demo.DemoFetchError as e:
        pytest.skip(f"demo model not downloadable here: {e}")
    with serve(["--model", "demo", "--max-num-seqs", "4"], OMP_NUM_THREADS="2") as sp:
        yield sp


class Wire:
    """The request bodies a library sent (path, JSON) and the ignored-fields headers augury answered."""

    def __init__(self, base_url: str) -> None:
        self.base_url = f"{base_url}/v1"
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.ignored: list[tuple[str, str]] = []

    def _request(self, request: Any) -> None:
        if request.method == "POST":
            self.sent.append((request.url.path, json.loads(request.content)))

    def _response(self, response: Any) -> None:
        if IGNORED_HEADER in response.headers:
            self.ignored.append((response.request.url.path, response.headers[IGNORED_HEADER]))

    # openai's own HTTP client classes (whichever httpx the installed openai is built on), with hooks
    def http(self) -> openai.DefaultHttpxClient:
        return openai.DefaultHttpxClient(event_hooks={"request": [self._request], "response": [self._response]},
                                         timeout=120)

    def ahttp(self) -> openai.DefaultAsyncHttpxClient:
        async def request(r: Any) -> None:
            self._request(r)

        async def response(r: Any) -> None:
            self._response(r)

        return openai.DefaultAsyncHttpxClient(event_hooks={"request": [request], "response": [response]},
                                              timeout=120)

    def aopenai(self) -> openai.AsyncOpenAI:
        """A fresh async client (made inside the event loop that uses it)."""
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, http_client=self.ahttp())

    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.sent]

    def last(self) -> dict[str, Any]:
        return self.sent[-1][1]


@pytest.fixture
def wire(server: ServerProcess) -> Iterator[Wire]:
    w = Wire(server.base_url)
    yield w
    assert not w.ignored, f"augury ignored fields these requests sent: {w.ignored}"


def check_arguments(body: dict[str, Any], name: str, arguments: dict[str, Any]) -> None:
    """The call's arguments validate under the parameters schema the library sent for `name`."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
    assert name in schemas, (name, list(schemas))
    jsonschema.validate(arguments, schemas[name])


def tool_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The assistant messages with tool calls and the tool results a round trip's last request carried."""
    calls = [m for m in body["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in body["messages"] if m["role"] == "tool"]
    return calls, results


def check_round_trip(body: dict[str, Any], answer: str) -> None:
    """The final request sent the call and its result back, and the answer is text drawn from the result."""
    calls, results = tool_messages(body)
    assert len(calls) == 1 and len(calls[0]["tool_calls"]) == 1
    call = calls[0]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    city = json.loads(call["function"]["arguments"])["city"]
    assert [r["tool_call_id"] for r in results] == [call["id"]]
    assert results[0]["content"] == weather(city)
    assert body.get("tool_choice") in (None, "auto")  # the answer is not forced to be another call
    # The demo model repeats the tool's words: the result reached its prompt.
    assert "sunny" in answer, answer


# --------------------------------------------------------------------------------------------------
# langchain-openai

def chat_openai(wire: Wire, **kw: Any):
    from langchain_openai import ChatOpenAI

    kw.setdefault("max_tokens", 80)
    return ChatOpenAI(model="demo", base_url=wire.base_url, api_key="none", temperature=0, max_retries=0,
                      http_client=wire.http(), **kw)


def lc_weather_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return weather(city)

    return get_weather


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(wire: Wire, method: str) -> None:
    out = chat_openai(wire).with_structured_output(City, method=method, include_raw=True).invoke(PROMPT_CITY)
    assert out["parsing_error"] is None and isinstance(out["parsed"], City)
    body, raw = wire.last(), out["raw"]
    if method == "function_calling":
        assert body["tool_choice"]["function"]["name"] == "City" and "response_format" not in body
        [call] = raw.tool_calls
        check_arguments(body, "City", call["args"])
        assert City(**call["args"]) == out["parsed"]
    else:
        assert body["response_format"]["type"] == {"json_schema": "json_schema", "json_mode": "json_object"}[method]
        assert City.model_validate_json(raw.content) == out["parsed"]


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_langchain_forced_tool_call(wire: Wire, choice: str) -> None:
    msg = chat_openai(wire).bind_tools([lc_weather_tool()], tool_choice=choice).invoke(PROMPT_WEATHER)
    body = wire.last()
    assert body["tool_choice"] == ("required" if choice == "any" else
                                   {"type": "function", "function": {"name": "get_weather"}})
    assert msg.tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"
    for call in msg.tool_calls:
        assert call["name"] == "get_weather" and call["id"]
        check_arguments(body, "get_weather", call["args"])


def test_langchain_tool_round_trip(wire: Wire) -> None:
    from langchain_core.messages import HumanMessage

    tool = lc_weather_tool()
    llm = chat_openai(wire)
    history: list[Any] = [HumanMessage(PROMPT_WEATHER)]
    call = llm.bind_tools([tool], tool_choice="get_weather", parallel_tool_calls=False).invoke(history)
    assert len(call.tool_calls) == 1 and wire.last()["parallel_tool_calls"] is False
    history += [call, tool.invoke(call.tool_calls[0])]
    answer = llm.bind_tools([tool]).invoke(history)
    assert not answer.tool_calls and answer.response_metadata["finish_reason"] == "stop"
    check_round_trip(wire.last(), answer.content)


def test_langchain_streaming(wire: Wire) -> None:
    llm = chat_openai(wire, max_tokens=60)
    whole = llm.invoke(PROMPT_TEXT).content
    chunks = list(llm.stream(PROMPT_TEXT))
    assert wire.last()["stream"] is True and len(chunks) > 2
    assert "".join(c.content for c in chunks) == whole and whole
    # Streamed tool calls: the chunks add up to the same call as the whole answer's.
    bound = llm.bind_tools([lc_weather_tool()], tool_choice="get_weather", parallel_tool_calls=False)
    call = bound.invoke(PROMPT_WEATHER).tool_calls
    merged = None
    for chunk in bound.stream(PROMPT_WEATHER):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and len(merged.tool_call_chunks) == 1
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in call]


def test_langchain_responses_api(wire: Wire) -> None:
    llm = chat_openai(wire, use_responses_api=True)
    whole = llm.invoke(PROMPT_TEXT).text
    assert whole and [path for path, _ in wire.sent] == ["/v1/responses"]
    assert "".join(c.text for c in llm.stream(PROMPT_TEXT)) == whole  # temperature 0: the same answer


# --------------------------------------------------------------------------------------------------
# pydantic-ai

def pai_model(wire: Wire):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("demo", provider=OpenAIProvider(openai_client=wire.aopenai()))


SETTINGS = {"temperature": 0, "max_tokens": 80}


@pytest.mark.parametrize("mode", ["tool", "native", "prompted"])
def test_pydantic_ai_output_modes(wire: Wire, mode: str) -> None:
    from pydantic_ai import Agent, NativeOutput, PromptedOutput, ToolOutput

    output = {"tool": ToolOutput(City), "native": NativeOutput(City), "prompted": PromptedOutput(City)}[mode]

    async def run() -> Any:
        return await Agent(pai_model(wire), output_type=output, model_settings=SETTINGS, retries=0).run(PROMPT_CITY)

    result = asyncio.run(run())
    assert isinstance(result.output, City)
    body = wire.last()
    if mode == "tool":  # the output is a forced call of the output tool
        assert body["tool_choice"] == "required" and "response_format" not in body
        [call] = [p for m in result.all_messages() for p in getattr(m, "parts", []) if p.part_kind == "tool-call"]
        check_arguments(body, call.tool_name, call.args_as_dict())
    else:
        assert body["response_format"]["type"] == {"native": "json_schema", "prompted": "json_object"}[mode]
        assert City.model_validate_json(result.response.text) == result.output


def test_pydantic_ai_tool_round_trip(wire: Wire) -> None:
    from pydantic_ai import Agent, RunContext

    calls: list[str] = []

    def settings(ctx: RunContext[None]) -> dict[str, Any]:  # force the tool on the first step only
        return {**SETTINGS, "parallel_tool_calls": False, **({"tool_choice": "required"} if ctx.run_step == 1 else {})}

    async def run() -> Any:
        agent = Agent(pai_model(wire), model_settings=settings, retries=0)

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Get the current weather for a city."""
            calls.append(city)
            return weather(city)

        return await agent.run(PROMPT_WEATHER)

    result = asyncio.run(run())
    first, last = wire.bodies()[0], wire.last()
    assert len(wire.sent) == 2 and first["tool_choice"] == "required"
    check_arguments(first, "get_weather", {"city": calls[0]})
    assert len(calls) == 1 and isinstance(result.output, str)
    check_round_trip(last, result.output)


def test_pydantic_ai_streaming(wire: Wire) -> None:
    from pydantic_ai import Agent, NativeOutput

    async def run() -> tuple[str, list[str], City, City]:
        model = pai_model(wire)
        agent = Agent(model, model_settings={**SETTINGS, "max_tokens": 60})
        whole = (await agent.run(PROMPT_TEXT)).output
        async with agent.run_stream(PROMPT_TEXT) as stream:
            deltas = [d async for d in stream.stream_text(delta=True, debounce_by=None)]
        typed = Agent(model, output_type=NativeOutput(City), model_settings=SETTINGS, retries=0)
        city = (await typed.run(PROMPT_CITY)).output
        async with typed.run_stream(PROMPT_CITY) as stream:
            streamed_city = await stream.get_output()
        return whole, deltas, city, streamed_city

    whole, deltas, city, streamed_city = asyncio.run(run())
    assert sum(body.get("stream") is True for body in wire.bodies()) == 2
    assert len(deltas) > 2 and "".join(deltas) == whole and whole
    assert streamed_city == city


def test_pydantic_ai_responses_api(wire: Wire) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from pydantic_ai.exceptions import ModelNotFoundError

    async def run() -> Any:
        model = OpenAIResponsesModel("demo", provider=OpenAIProvider(openai_client=wire.aopenai()))
        try:
            return await Agent(model, model_settings=SETTINGS, retries=0).run(PROMPT_TEXT)
        except ModelNotFoundError as e:  # pydantic-ai's name for the client's 404: raise the 404 itself
            raise e.__cause__ from None

    assert asyncio.run(run()).output and [path for path, _ in wire.sent] == ["/v1/responses"]


# --------------------------------------------------------------------------------------------------
# OpenAI Agents SDK (its Chat Completions model; its default, the Responses model, at the end)

@pytest.fixture
def agents_sdk() -> Iterator[None]:
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # traces would be exported to OpenAI
    yield


def sdk_agent(wire: Wire, responses: bool = False, **kw: Any):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel

    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    settings = ModelSettings(temperature=0, max_tokens=kw.pop("max_tokens", 80), **kw.pop("settings", {}))
    return Agent(name="helper", instructions="You are a helpful assistant.", model_settings=settings,
                 model=kind(model="demo", openai_client=wire.aopenai()), **kw)


def sdk_weather_tool(calls: list[str]):
    from agents import function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return weather(city)

    return get_weather


def test_agents_structured_output(wire: Wire, agents_sdk: None) -> None:
    from agents import Runner

    result = asyncio.run(Runner.run(sdk_agent(wire, output_type=City), PROMPT_CITY))
    assert isinstance(result.final_output, City)
    fmt = wire.last()["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_agents_tool_round_trip(wire: Wire, agents_sdk: None, choice: str) -> None:
    from agents import Runner

    calls: list[str] = []
    agent = sdk_agent(wire, tools=[sdk_weather_tool(calls)],
                      settings={"tool_choice": choice, "parallel_tool_calls": False})
    result = asyncio.run(Runner.run(agent, PROMPT_WEATHER))
    first = wire.bodies()[0]
    want = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    assert len(wire.sent) == 2 and first["tool_choice"] == want  # the SDK resets tool_choice after a call
    assert len(calls) == 1
    check_arguments(first, "get_weather", {"city": calls[0]})
    check_round_trip(wire.last(), result.final_output)


def test_agents_streaming(wire: Wire, agents_sdk: None) -> None:
    from agents import Runner

    async def streamed(agent, prompt: str) -> tuple[list[str], Any]:
        run = Runner.run_streamed(agent, prompt)
        deltas = [e.data.delta async for e in run.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        return deltas, run.final_output

    def tool_agent(calls: list[str]):
        return sdk_agent(wire, tools=[sdk_weather_tool(calls)],
                         settings={"tool_choice": "required", "parallel_tool_calls": False})

    async def run() -> None:  # one event loop: the agents' async clients live in it
        agent = sdk_agent(wire, max_tokens=60)
        whole = (await Runner.run(agent, PROMPT_TEXT)).final_output
        deltas, final = await streamed(agent, PROMPT_TEXT)
        assert wire.last()["stream"] is True
        assert len(deltas) > 2 and "".join(deltas) == final == whole and whole
        # A streamed tool round trip ends as the whole one does.
        plain_calls: list[str] = []
        plain = await Runner.run(tool_agent(plain_calls), PROMPT_WEATHER)
        calls: list[str] = []
        _, final = await streamed(tool_agent(calls), PROMPT_WEATHER)
        assert calls == plain_calls and len(calls) == 1 and final == plain.final_output

    asyncio.run(run())


def test_agents_responses_api(wire: Wire, agents_sdk: None) -> None:
    """The SDK's default model: a response cut by max_output_tokens is an error to it (status
    incomplete), and the demo at temperature 0 goes on about Paris for thousands of tokens, so a question
    with a short answer; a forced tool round trip, whole and streamed."""
    from agents import Runner

    short = "What is the capital of France? Answer in one word."
    assert "Paris" in asyncio.run(Runner.run(sdk_agent(wire, responses=True, max_tokens=400), short)).final_output
    assert [path for path, _ in wire.sent] == ["/v1/responses"]

    def tool_agent(calls: list[str]):
        return sdk_agent(wire, responses=True, max_tokens=400, tools=[sdk_weather_tool(calls)],
                         settings={"tool_choice": "required", "parallel_tool_calls": False})

    async def run() -> None:
        calls: list[str] = []
        plain = await Runner.run(tool_agent(calls), PROMPT_WEATHER)
        first, last = wire.sent[-2][1], wire.sent[-1][1]
        assert len(calls) == 1 and first["tool_choice"] == "required"
        outputs = [i for i in last["input"] if i.get("type") == "function_call_output"]
        assert [o["output"] for o in outputs] == [weather(calls[0])]  # the result went back
        assert "sunny" in plain.final_output, plain.final_output  # and reached the prompt
        streamed_calls: list[str] = []
        run = Runner.run_streamed(tool_agent(streamed_calls), PROMPT_WEATHER)
        async for _ in run.stream_events():
            pass
        assert streamed_calls == calls and run.final_output == plain.final_output

    asyncio.run(run())
