"""Responders, the brain that turns a conversation into reply text: the contract (contract.py), the OpenAI-
compatible one, and the parsers of a local LM's tool calls."""
