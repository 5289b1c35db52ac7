"""Old name of :mod:`zoo.interfaces`, kept so that plugins importing from it keep working."""

from zoo.interfaces import *  # noqa: F401,F403
from zoo.interfaces import ForwardContext, PositionEncoding, PositionState, Rotary, build_part  # noqa: F401
