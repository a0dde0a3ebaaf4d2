"""The wires the loopback server speaks, one module each, listed in `WIRES`.

A wire is a `Wire` object (see `base`): it decodes its request, encodes its reply and its stream
events, and shapes its errors. A new wire is one module with a `Wire` subclass, added to `WIRES`.
"""

from workbench.server.wires.anthropic_messages import AnthropicMessages
from workbench.server.wires.base import Wire
from workbench.server.wires.openai_chat import OpenAIChat
from workbench.server.wires.openai_responses import OpenAIResponses

# the first also answers, in its error shape, a request for a path no wire serves
WIRES: tuple[Wire, ...] = (OpenAIChat(), AnthropicMessages(), OpenAIResponses())


def wire_at(wires: tuple[Wire, ...], path: str) -> Wire:
    """The wire a request path names by its last part (`.../messages` is Anthropic's, whether
    served there or not); the first wire when none does."""
    endpoint = path.rpartition("/")[2]
    for wire in wires:
        if wire.path.rpartition("/")[2] == endpoint:
            return wire
    return wires[0]
