"""Errors a user can cause. The CLI prints them as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """A problem the user can fix: bad flag, missing model, over-long prompt, corrupt file."""

    exit_code = 2


class ModelLoadError(UserError):
    """The model folder or registry entry cannot be loaded."""


class ContextOverLimit(ModelLoadError):
    """--max-context (max_model_len) asks for more positions than the model has."""

    def __init__(self, max_model_len: int, limit: int):
        self.max_model_len, self.limit = max_model_len, limit
        super().__init__(f"max context {max_model_len} exceeds the model's limit of {limit} tokens")


class SettingError(UserError):
    """An engine or model setting with a value that cannot work. The message names the setting by its
    EngineConfig name; a front end re-words it with its own name for it (`settings.cli_words`: the flag)."""

    def __init__(self, setting: str, template: str):
        self.setting, self.template = setting, template   # template: "{name} must be ...", name filled in
        super().__init__(template.format(name=setting))

    def named(self, name: str) -> str:
        return self.template.format(name=name)


class RequestError(UserError):
    """A single request cannot be served (too long for the context or the whole pool)."""


# -- why a request does not fit: raised by Engine.check_prompt / add_request, worded again by each front end ----
class EmptyPrompt(RequestError):
    def __init__(self):
        super().__init__("the prompt is empty")


class TooManyVariants(RequestError):
    """More variants than the engine runs at once (EngineConfig.max_num_seqs): they would only thrash."""

    def __init__(self, n: int, limit: int):
        self.n, self.limit = n, limit
        super().__init__(f"{n} variants is more than the {limit} sequences the engine runs at once")


class ContextTooLong(RequestError):
    """The prompt leaves no room for a single generated token in the model's context."""

    def __init__(self, prompt_tokens: int, max_model_len: int):
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        super().__init__(f"prompt is {prompt_tokens} tokens but the model's context is {max_model_len} tokens "
                         f"(at least one must be left to generate)")


class PoolTooSmall(RequestError):
    """The prompt (plus one token) needs more blocks than the whole KV pool has, even with nothing else in it."""

    def __init__(self, prompt_tokens: int, capacity_tokens: int, num_blocks: int):
        self.prompt_tokens, self.capacity_tokens, self.num_blocks = prompt_tokens, capacity_tokens, num_blocks
        super().__init__(self.advise("raise the engine's kv_memory"))

    def advise(self, advice: str) -> str:
        """The message with a front end's own way out (`raise --kv-memory`, a server restart, ...)."""
        return (f"prompt is {self.prompt_tokens} tokens but the whole KV pool holds {self.capacity_tokens} tokens "
                f"({self.num_blocks} block{'' if self.num_blocks == 1 else 's'}); {advice}")


def outgrew_pool(num_blocks: int, block_size: int) -> str:
    """Why a sequence failed that no longer fits even alone in the pool (it ends with this error, its siblings go on)."""
    return (f"request needs more KV memory than the whole pool ({num_blocks} blocks of {block_size} tokens); "
            f"raise --kv-memory")
