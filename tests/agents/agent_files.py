"""Paths of the agent tests' user files."""
import os

TOOLS = os.path.join(os.path.dirname(__file__), "agent_tools.py")


def tool_specs(*names: str) -> list[str]:
    return [f"{TOOLS}:{n}" for n in names]
