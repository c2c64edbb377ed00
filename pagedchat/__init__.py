"""pagedchat: chat, fork and compare replies on one shared paged KV-cache pool."""

__version__ = "0.1.0"
