"""rtmedia.web."""

from rtmedia.protocol.import_names import step_aside

step_aside(__name__, __file__)
