"""models.toml keys pagedchat does not read (`kv`, `keep_alive`) are refused with their file:line, never
accepted and silently ignored."""

import pytest

from pagedchat.errors import UserError
from pagedchat.registry import Registry


@pytest.mark.parametrize("text, line, key", [
    ('[defaults]\nkeep_alive = "5m"\n', 2, "keep_alive"),
    ('[models.x]\nsource = "/tmp"\nkeep_alive = "5m"\n', 3, "keep_alive"),
    ('[models.x]\nsource = "/tmp"\nkv = {memory = "1GiB"}\n', 3, "kv"),
    ('[models.x]\nsource = "/tmp"\n\n[models.x.kv]\nmemory = "1GiB"\n', 4, "kv"),
])
def test_unread_keys_are_refused_with_their_line(tmp_path, text, line, key):
    toml = tmp_path / "models.toml"
    toml.write_text(text)
    with pytest.raises(UserError, match=rf"models.toml:{line}: .* {key} is not a setting pagedchat reads"):
        Registry(user=toml)
