"""fasttrain.host: the CPU facts and the one cache folder.

The cache: $FASTTRAIN_CACHE names it for every user (the measured rates, the selftest's verdicts,
the converted bundled model); the old $FASTTRAIN_CACHE_DIR is read only when $FASTTRAIN_CACHE is
unset, with one FutureWarning per process; with neither, $XDG_CACHE_HOME/fasttrain.
"""
import warnings

import pytest

from fasttrain import host


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("FASTTRAIN_CACHE", "FASTTRAIN_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(host, "_warned_old_var", False)
    return monkeypatch


def test_one_variable_names_the_cache_of_every_user(clean_env, tmp_path):
    from fasttrain.models.bundled import converted_dir_for
    from fasttrain.plan.host_rates import cache_path
    from fasttrain.selftest import verdict_path

    clean_env.setenv("FASTTRAIN_CACHE", str(tmp_path / "new"))
    clean_env.setenv("FASTTRAIN_CACHE_DIR", str(tmp_path / "old"))      # the new variable wins, silently
    f = tmp_path / "x.gguf"
    f.write_bytes(b"0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host.cache_root() == tmp_path / "new"
        assert cache_path() == tmp_path / "new" / "host_rates.json"
        assert verdict_path() == tmp_path / "new" / "selftest_verdicts.json"
        assert converted_dir_for(f).parent == tmp_path / "new" / "models"


def test_the_old_variable_is_still_read_with_one_warning(clean_env, tmp_path):
    clean_env.setenv("FASTTRAIN_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match="FASTTRAIN_CACHE_DIR .* set FASTTRAIN_CACHE="):
        assert host.cache_root() == tmp_path / "old"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                  # once per process
        assert host.cache_root() == tmp_path / "old"


def test_without_either_variable_the_xdg_cache_home(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host.cache_root() == tmp_path / "xdg" / "fasttrain"


def test_the_cpu_facts_are_public():
    """cpu_name is /proc/cpuinfo's model name where Linux has one; cpu_bf16_compute is the
    extension's own answer, the same one the op faces read."""
    from pathlib import Path

    from fasttrain import _native

    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
             if ln.startswith("model name")] if info.exists() else []
    if names:
        assert host.cpu_name() == names[0]
    else:
        assert host.cpu_name()
    assert host.cpu_bf16_compute() is bool(_native.load().cpu_has_bf16())
