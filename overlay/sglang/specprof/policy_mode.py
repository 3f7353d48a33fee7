"""The cost policy's other modes, for benchmarks: upstream's rule (`ema`, `ema-all`,
`ema:PATH`) or a pinned step count in place of the cost policy's choice, and the mode file
that switches between them while the server runs.

With `SGLANG_SPECPROF_POLICY_FILE` set (`follow_file`), each read of /server_info (on the
scheduler's thread, between batches) takes the mode from that file when it changed: `cost`,
`ema` (upstream's rule) or a step count to pin every tier to; the answer's
`speculative_profile.adaptive_policy` says which is in force. So one server runs the static
settings, upstream's policy and this one round by round.
"""

from __future__ import annotations

import logging
import os
import stat

from sglang_specprof.table import printable

logger = logging.getLogger("sglang.specprof")

POLICY_FILE_ENV = "SGLANG_SPECPROF_POLICY_FILE"
SLOT_SETTINGS = ("ema_alpha", "update_interval", "warmup_batches", "down_hysteresis", "up_hysteresis",
                 "ceiling_coeff")  # upstream's per-tier settings, kept where `ema-all` changes the candidates


class Modes:
    """A part of `CostPolicy` (policy.py): its modes other than `cost`. It sets `mode`, `pinned`
    and `rule`, which the controller's calls read; of the policy it reads `up` (upstream's
    chooser), `tiers`, `bs_list`, `launch_steps`, `candidate_steps`, `cuda_graph_bs_for_step`
    and `state`."""

    def __init__(self):
        self.mode_file = None  # benchmarks: where `reread` takes the mode from (follow_file)
        self._mode_text = None  # the bytes last read from mode_file
        self._file_problems: set = set()  # what was wrong with mode_file, each warned once
        self._rules = {}  # benchmarks: the upstream rules built for `ema-all` and `ema:PATH`

    def reread(self) -> None:
        """The mode from `mode_file` (its first word), when the file changed since the last read.
        Never raises nor blocks (it runs on the scheduler's thread): a file that is not a
        regular one, or not UTF-8, is refused with one warning per distinct problem."""
        if self.mode_file is None:
            return
        data = self._read_mode_file()
        if data is None or data == self._mode_text:
            return
        self._mode_text = data
        try:
            words = data.decode("utf-8").split()
        except UnicodeDecodeError:
            self._file_problem("is not UTF-8 text")
            return
        self._file_problems.clear()  # read: a problem seen again is told again
        try:
            self.set_mode(words[0] if words else "")
            logger.info("speculative adaptive policy: %s", printable(self.state()["mode"]))
        except ValueError as e:
            logger.warning("speculative adaptive policy: mode unchanged (%s)", printable(str(e)))

    def _read_mode_file(self):
        """The first 256 bytes of `mode_file`, or None (not there yet, or refused)."""
        try:
            fd = os.open(self.mode_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
        except FileNotFoundError:
            return None  # not written yet
        except OSError as e:
            self._file_problem(f"cannot be read ({e.strerror or e})")
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._file_problem("is not a regular file")
                return None
            return os.read(fd, 256)
        except OSError as e:
            self._file_problem(f"cannot be read ({e.strerror or e})")
            return None
        finally:
            os.close(fd)

    def _file_problem(self, what: str) -> None:
        """One warning per distinct problem with `mode_file` (each /server_info reads it)."""
        if what not in self._file_problems:
            self._file_problems.add(what)
            logger.warning("speculative adaptive policy: mode unchanged (%s=%s %s).", POLICY_FILE_ENV,
                           printable(self.mode_file), what)

    def set_mode(self, text: str) -> None:
        """`cost`; `ema` (upstream's rule on its own tiers); `ema-all` (upstream's rule over this
        policy's candidates); `ema:PATH` (upstream's rule with the config file PATH, e.g. one
        `report --adaptive-config` wrote); or a step count to pin every tier to (benchmarks)."""
        text = text.strip()
        if text == "cost":
            self.mode, self.pinned = "cost", None
        elif text == "ema" or text == "ema-all" or text.startswith("ema:"):
            rule = self.up if text == "ema" else self._rule(text)
            self.mode, self.pinned, self.rule = "ema", None, rule
        elif text.isdigit() and int(text) in self.candidate_steps:
            self.pinned = int(text)
        else:
            raise ValueError(f"not a mode: {text!r} (cost, ema, ema-all, ema:CONFIG, or one of the candidate "
                             f"steps {self.candidate_steps})")

    def mode_name(self) -> str:
        if self.pinned is not None:
            return f"pinned {self.pinned}"
        if self.mode == "ema" and self.rule is not self.up:
            return next((k for k, r in self._rules.items() if r is self.rule), "ema")
        return self.mode

    def _rule(self, text):
        """Upstream's own chooser, made afresh from a config: this policy's candidates per tier
        (`ema-all`, upstream's other settings of each tier kept) or the file after `ema:`. Its
        step counts must be ones this server has graphs for."""
        if text in self._rules:
            return self._rules[text]
        import json
        import tempfile

        path = text[4:] if text.startswith("ema:") else None
        initial = self.launch_steps if self.launch_steps is not None else self.tiers[self.bs_list[0]].steps
        try:
            if path is None:
                cfg = {}
                for bs, slot in self.up._slots.items():
                    cfg[str(bs)] = {k: getattr(slot, k) for k in SLOT_SETTINGS if hasattr(slot, k)}
                    cfg[str(bs)]["candidate_steps"] = list(self.tiers[bs].candidates)
                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                    json.dump(cfg, f)
                try:
                    rule = type(self.up)(initial_steps=initial, cfg_path=f.name)
                finally:
                    os.remove(f.name)
            else:
                rule = type(self.up)(initial_steps=initial, cfg_path=path)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{text}: {type(e).__name__}: {e}") from None
        missing = sorted(set(rule.candidate_steps) - set(self.candidate_steps))
        if missing:
            raise ValueError(f"{text}: step counts {missing} are not among this server's {self.candidate_steps}")
        graphs = self.up._cuda_graph_bs
        rule.set_cuda_graph_bs(graphs)
        for v in graphs or ():  # each captured batch size: a graph for every step count its tier may run
            lacking = [c for c in rule._route(v).candidate_steps if v not in (self.cuda_graph_bs_for_step(c) or ())]
            if lacking:
                raise ValueError(f"{text}: this server has no graphs at batch size {v} for step counts {lacking}")
        self._rules[text] = rule
        return rule


def follow_file(policy: Modes) -> None:
    """SGLANG_SPECPROF_POLICY_FILE=PATH: `reread` (each /server_info) takes the mode from PATH."""
    path = os.environ.get(POLICY_FILE_ENV)
    if path:
        policy.mode_file = path
        logger.info("speculative adaptive policy: each /server_info reads its mode from %s", printable(path))
