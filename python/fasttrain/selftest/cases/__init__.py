"""The selftest's cases, one module per op family; each `*_cases(device, quick)` returns the
family's cases as (name, run) or (name, run, "face:implementation"), run(check) -> (kernel s, reference s)."""
