import asyncio
from openai import AsyncOpenAI
from agents import Agent, Runner, function_tool, OpenAIResponsesModel, set_tracing_disabled, ModelSettings
set_tracing_disabled(True)
client = AsyncOpenAI(base_url="http://localhost:8011/v1", api_key="x")

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    print("TOOL CALLED with", repr(city))
    return f"sunny in {city}"

agent = Agent(name="w", instructions="Use tools.", tools=[get_weather],
              model=OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=client),
              model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0.0))
async def main():
    r = await Runner.run(agent, "Weather in Oslo?", max_turns=3)
    print("FINAL:", repr(r.final_output))
    r = Runner.run_streamed(Agent(name="p", instructions="Be brief.", model=OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=client), model_settings=ModelSettings(max_tokens=300, temperature=0.0)), "Say hi in three words")
    async for ev in r.stream_events(): pass
    print("STREAMED FINAL:", repr(r.final_output))
asyncio.run(main())
