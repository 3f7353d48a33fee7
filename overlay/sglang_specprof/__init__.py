"""sglang-specprof's analysis: windows, the profile schema, tables, the advisor, reports.

Plain Python: it imports neither torch nor SGLang, so profiles can be read, reported and
compared on any machine that has only this wheel (installed with --no-deps).
The server side, which records the events, is sglang.specprof.
"""
