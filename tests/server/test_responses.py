"""OpenAI's Responses API (/v1/responses) through the official `openai` client against the live
test server: the same tokens as the chat request it stands for, its stream of typed events,
text.format and function tools, whole conversations with earlier calls, and clear 400s.
"""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from hetero.server.protocol import ResponsesRequest
from hetero.server.responses import chat_request
from server_helpers import live_server

GREEDY = {"temperature": 0.0}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with live_server(tiny_llama_dir) as live:
        yield openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(client):
    response = client.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.",
                                       max_output_tokens=12, **GREEDY)
    chat = client.chat.completions.create(model="tiny", max_tokens=12, **GREEDY, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_the_stream_is_the_responses_events_in_order_and_adds_up_to_the_response(client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "Count to five."}]}],
                  max_output_tokens=16, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_text_format_constrains_the_output_as_response_format_does(client):
    response = client.responses.create(model="tiny", input="Answer in JSON.", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)

    class Verdict(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        score: int = pydantic.Field(ge=0, le=9)

    parsed = client.responses.parse(model="tiny", input="Answer in JSON.", text_format=Verdict, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Verdict)
    anything = client.responses.create(model="tiny", input="JSON.", max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert anything.output_text.startswith("{")  # a random model's object may run past the limit
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


def test_required_and_named_tools_give_function_calls_and_the_conversation_goes_on(client):
    called = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=200, **GREEDY)
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200, **GREEDY))
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert done.arguments == events[-1].response.output[-1].arguments
    assert set(json.loads(done.arguments)) == {"city"}  # no properties the tool does not have

    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model="tiny", input=history, tools=[WEATHER], max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(model="tiny", max_tokens=8, **GREEDY, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert answer.output_text == chat.choices[0].message.content


def test_input_items_become_chat_messages():
    request = ResponsesRequest(input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": {"ok": True}},
    ], instructions="Be brief.", max_output_tokens=5)
    chat = chat_request(request)
    messages = [message.for_template() for message in chat.messages]
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool"]
    assert messages[2]["content"] == "ab" and chat.output_limit == 5
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}


@pytest.mark.parametrize("fields, message", [
    ({"previous_response_id": "resp_1"}, "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "function tools are"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "not supported"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": []}, "no messages"),
    ({"max_output_tokens": 0}, "max_output_tokens must be at least 1"),
])
def test_what_the_server_cannot_do_is_a_400_that_says_so_in_the_responses_names(client, fields, message):
    with pytest.raises(openai.BadRequestError, match=message) as error:
        client.responses.create(**{"model": "tiny", "input": "x", **fields})
    assert error.value.body.get("param") not in ("max_completion_tokens", "messages", "response_format")


def test_a_misspelt_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="max_output_tokenz"):
        client.responses.create(model="tiny", input="x", extra_body={"max_output_tokenz": 5})
