"""Where the secrets come from and how a token rotates: a process sends its first cluster
token and accepts any it lists (tests/integration/test_auth.py checks the servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_common.net import auth


def test_a_token_file_lists_the_one_sent_first_then_those_also_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text("new-token\n\n old-token \n")
    monkeypatch.delenv("OMNISTAGE_CLUSTER_TOKEN", raising=False)
    monkeypatch.setenv("OMNISTAGE_CLUSTER_TOKEN_FILE", str(path))
    assert auth.cluster_tokens() == ["new-token", "old-token"]
    assert auth.cluster_metadata() == ((auth.CLUSTER_TOKEN_HEADER, "new-token"),)


def test_no_secret_means_open_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CLUSTER_TOKEN", "CLUSTER_TOKEN_FILE", "API_KEYS", "API_KEYS_FILE"):
        monkeypatch.delenv(f"OMNISTAGE_{name}", raising=False)
    assert auth.cluster_metadata() == () and auth.api_keys() == []
    assert auth.describe([], []) == "internal RPCs OPEN (no cluster token); public API open"


def test_keys_match_only_exactly_and_any_listed_one() -> None:
    keys = ["alpha", "beta"]
    assert auth._matches("beta", keys) and auth._matches("alpha", keys)
    for given in ("alph", "alphaa", "", None, b"alpha"):
        assert not auth._matches(given, keys)
    assert auth._api_key({"authorization": "Bearer beta"}) == "beta"
    assert auth._api_key({auth.API_KEY_HEADER: "alpha"}) == "alpha"
