"""The scheduler and its lanes (the only owner of engines), the LM lane, the typed engine handles sessions
use, placement and the responders a server offers."""
