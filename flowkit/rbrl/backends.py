"""The chat backends' earlier class paths (``flowkit.rbrl.backends.HTTPChatBackend`` / ``HFChatBackend`` in configs
written against an earlier README); they live in :mod:`flowkit.llm.chat_backends`."""

from flowkit.llm.chat_backends import ChatBackend, HFChatBackend, HTTPChatBackend

__all__ = ["ChatBackend", "HFChatBackend", "HTTPChatBackend"]
