"""Tool calling: the hermes and llama3_json parsers, and tools / tool_choice through the openai client.

The tiny random model does not call tools of its own accord, so the server tests make it
write a call with `guided_choice` (the reply is forced to one exact string) and check
that the parser turns it into `tool_calls`, streamed and not.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from hetero.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, RequiredCalls, ToolCallStream
from server_helpers import live_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                    "required": ["zone"], "additionalProperties": False}},
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REPLY = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
LLAMA_REPLY = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}'


# ----------------------------------------------------------------- parsers
def test_hermes_parser():
    parser = HermesToolParser()
    content, calls = parser.split(HERMES_REPLY)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "C"})]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert [c.name for c in parser.split(two)[1]] == ["a", "b"]
    assert parser.split("no call here") == ("no call here", [])
    assert parser.split('<tool_call>{"name": "a", "argu')[1] == []  # cut short: stays text
    assert parser.content_end("Let me check.<tool_") == len("Let me check.")
    assert parser.content_end("Let me check.<tool_call>{") == len("Let me check.")
    assert parser.content_end("plain <b>text") == len("plain <b>text")


def test_llama3_json_parser():
    parser = Llama3JsonToolParser()
    content, calls = parser.split(LLAMA_REPLY)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome", "unit": "F"})]
    tagged = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    assert [c.name for c in parser.split(tagged)[1]] == ["a", "b"]
    assert parser.split("Rome is sunny.") == ("Rome is sunny.", [])
    assert parser.split('{"not": "a call"}')[1] == []
    assert parser.content_end("  {") == 0 and parser.content_end("<|pyth") == 0 and parser.content_end("Sunny") == 5


@pytest.mark.parametrize("parser, reply, content", [
    (HermesToolParser(), HERMES_REPLY, "Let me check."),
    (Llama3JsonToolParser(), LLAMA_REPLY, ""),
    (HermesToolParser(), "just <text>", "just <text>"),
])
def test_streamed_pieces_give_the_same_content_and_calls(parser, reply, content):
    stream = ToolCallStream(parser)
    sent = ""
    for i in range(0, len(reply), 3):
        piece, calls = stream.feed(reply[i:i + 3], finished=False)
        sent += piece
        assert calls == []
    piece, calls = stream.feed("", finished=True)
    assert sent + piece == content
    assert [c.name for c in calls] == [c.name for c in parser.split(reply)[1]]


def test_required_calls_read_the_json_array():
    assert [c.name for c in RequiredCalls().split('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')[1]] == ["get_time"]
    assert RequiredCalls().split('[{"name": "get_time", "param')[1] == []


# ----------------------------------------------------------------- server
@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def tool_server(request, tiny_llama_dir):
    with live_server(tiny_llama_dir, settings={"enable_auto_tool_choice": True, "tool_call_parser": request.param}) as live:
        yield request.param, openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_auto_tool_choice_parses_the_models_call_streamed_and_not(tool_server):
    parser, client = tool_server
    reply = HERMES_REPLY if parser == "hermes" else LLAMA_REPLY
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, TIME], "max_tokens": 200, "temperature": 0.0,
              "extra_body": {"guided_choice": [reply]}}
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert choice.message.content == ("Let me check." if parser == "hermes" else None)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == (choice.message.content or "")
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_reply_without_a_call_stays_content(tool_server):
    _, client = tool_server
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=20,
                                           temperature=0.0, extra_body={"guided_choice": ["It is sunny."]})
    assert whole.choices[0].message.content == "It is sunny." and not whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice_force_a_valid_call(tool_server, stream):
    _, client = tool_server

    def calls_of(**kwargs):
        kwargs = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, TIME], "max_tokens": 200, "temperature": 0.8, "seed": 3, **kwargs}
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], choice.finish_reason
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        return [(d.function.name, d.function.arguments) for d in deltas], [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    calls, finish = calls_of(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [name for name, _ in calls] == ["get_time"] and finish == "stop"
    jsonschema.validate(json.loads(calls[0][1]), TIME["function"]["parameters"])

    calls, finish = calls_of(tool_choice="required", parallel_tool_calls=False)
    assert len(calls) == 1 and finish == "tool_calls"
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0][0]]
    jsonschema.validate(json.loads(calls[0][1]), tool["function"]["parameters"])


def test_tool_choice_none_and_errors(tool_server, tiny_llama_dir):
    _, client = tool_server
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
    none = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0.0)
    assert none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="not among tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="required")


def test_auto_needs_the_servers_parser(tiny_llama_dir):
    with live_server(tiny_llama_dir) as live:
        client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="auto")
        default = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=4)
        assert not default.choices[0].message.tool_calls  # tools without a parser: "none", as vLLM


def test_earlier_tool_calls_reach_the_template_with_object_arguments():
    from hetero.server.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[call]).for_template()
    assert message["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert call["function"]["arguments"] == '{"zone": "UTC"}'  # the request itself is left as it came


# ChatML as SmolLM2's template writes it: the content joined with "+", which fails on a missing one.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_turn_that_only_called_tools_goes_back_to_a_template_that_reads_its_content(tool_server):
    """The OpenAI client sends an assistant turn that only called tools back with content null;
    a template that concatenates message['content'] must still render it (as "")."""
    _, client = tool_server
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=4, extra_body={"chat_template": CHATML})
    assert reply.choices[0].message.content is not None
