"""--speculative-profile and its options: the command line, and the check at startup.

ServerArgs carries five fields (speculative_profile, speculative_profile_interval,
speculative_profile_output, speculative_profile_kernels, speculative_profile_phases_every); the patch to server_args.py calls into this module so that
the options and their validation live here, not in upstream's file.
"""

from __future__ import annotations

import argparse
import os
import re
import stat

from .jsonl import rank_path

# NEXTN is SGLang's name for EAGLE on MTP layers: 0.5.8 checks the flag before it renames it.
# STANDALONE's worker is the EAGLE worker with a draft model of its own; NGRAM's,
# FROZEN_KV_MTP's, DFLASH's, DSPARK's and UNO's cycles are wrapped from the overlay (ngram.py,
# frozen_kv.py, block_draft.py, uno.py), FROZEN_KV_MTP's from FROZEN_KV_FROM on and DFLASH's
# from DFLASH_FROM on (SINCE): every algorithm the releases ship.
PROFILED_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "FROZEN_KV_MTP", "DFLASH", "DSPARK",
                       "UNO")
INTERVAL = 100  # decode cycles a window by default
MAX_INTERVAL = 1_000_000  # hours of decoding at any batch size: a larger window would never close
KERNELS_EVERY = 400  # --speculative-profile-kernels without N: one sample every 400 windows (about 0.24 s each)
PHASES_EVERY = 4  # each batch size's cycles timed phase by phase one in 4 (the rest: start and end only)
ADAPTIVE_POLICIES = ("ema", "cost")
# A series that times --speculative-adaptive (it passes each cycle's step count to the profiler
# and hooks the adaptive controller) adds this field to ServerArgs; without it, the profiler
# refuses adaptive speculation rather than mix step counts in one bucket.
ADAPTIVE_FIELD = "speculative_adaptive_policy"


class SpecProfileArgError(ValueError):
    """A --speculative-profile option that cannot work; the message is one sentence."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding profiler (sglang-specprof)")
    group.add_argument(
        "--speculative-profile",
        action="store_true",
        default=False,
        help="Time every EAGLE/EAGLE3/STANDALONE/NGRAM speculative decode cycle phase by phase on the GPU "
        "(CUDA events, no added synchronisation) and report per phase, per draft step and "
        "per position in the log, /server_info and, with --enable-metrics, Prometheus. "
        "Without --speculative-algorithm each forward is timed whole: the baseline for a "
        "step-0 cycle.",
    )
    group.add_argument(
        "--speculative-profile-interval",
        type=int,
        default=INTERVAL,
        metavar="N",
        help=f"Decode cycles per summary window (default: {INTERVAL}).",
    )
    group.add_argument(
        "--speculative-profile-output",
        type=str,
        default=None,
        metavar="PATH",
        help="Append one JSON object per summary window to this JSONL file.",
    )
    group.add_argument(
        "--speculative-profile-kernels",
        type=int,
        nargs="?",
        const=KERNELS_EVERY,
        default=0,
        metavar="N",
        help="Every N windows, record a few decode cycles at kernel level with the torch "
        "profiler (CUPTI) and break each phase down into GEMM, attention, communication, "
        f"sampling, copies and idle time (no N: {KERNELS_EVERY}; default: off).",
    )
    group.add_argument(
        "--speculative-profile-phases-every",
        type=int,
        default=PHASES_EVERY,
        metavar="K",
        help="Time every cycle on the GPU, and its phases and draft steps in one cycle of K "
        "of each batch size (the others record two events, not twelve). 1: every phase of "
        f"every cycle, at about three times the host time (default: {PHASES_EVERY}).",
    )
    if "--speculative-adaptive" not in getattr(parser, "_option_string_actions", {}):
        return  # no adaptive speculation here (before 0.5.12): no policy option, and no prefix
        # of it for argparse to take `--speculative-adaptive` for
    group.add_argument(
        "--speculative-adaptive-policy",
        choices=ADAPTIVE_POLICIES,
        default=None,
        help="With --speculative-adaptive: how each batch-size tier picks its step count. ema: "
        "upstream's rule (one step more than the average accept length); cost: the candidate "
        "with the highest tokens/s from the live profile (measured per step count, exploring the "
        "others), needs --speculative-profile (default: ema).",
    )


def validate(args) -> None:
    """Raise SpecProfileArgError if the profiler options cannot work together."""
    policy = getattr(args, ADAPTIVE_FIELD, None)
    if policy is not None:
        if policy not in ADAPTIVE_POLICIES:
            raise SpecProfileArgError(f"--speculative-adaptive-policy takes {' or '.join(ADAPTIVE_POLICIES)}, "
                                      f"not {policy}.")
        if not getattr(args, "speculative_adaptive", False):
            raise SpecProfileArgError("--speculative-adaptive-policy only takes effect with --speculative-adaptive; "
                                      "add it.")
        if policy == "cost" and not getattr(args, "speculative_profile", False):
            raise SpecProfileArgError("--speculative-adaptive-policy cost takes its figures from the profile: add "
                                      "--speculative-profile.")
    _check_values(args)
    if not getattr(args, "speculative_profile", False):
        for opt, default in (("output", None), ("kernels", 0), ("phases_every", PHASES_EVERY),
                             ("interval", INTERVAL)):
            value = getattr(args, f"speculative_profile_{opt}", default)
            if value and value != default:
                raise SpecProfileArgError(
                    f"--speculative-profile-{opt.replace('_', '-')} only takes effect with --speculative-profile; "
                    f"add it."
                )
        return
    algo = args.speculative_algorithm
    # without speculation each forward is timed whole (plain.py): the baseline a step-0 cycle
    # is compared with
    if multi_layer_eagle(args) and not multi_layer_timed():
        # up to 0.5.15 its worker verifies with code of its own (no hook inside): served, the
        # profile would stay empty
        raise SpecProfileArgError("--speculative-profile times --enable-multi-layer-eagle from SGLang "
                                  f"{'.'.join(map(str, MULTI_LAYER_FROM))} on; profile without it here.")
    if algo is not None and str(algo).upper() not in PROFILED_ALGORITHMS:
        raise SpecProfileArgError(
            f"--speculative-profile times the EAGLE, EAGLE3, STANDALONE, NGRAM, FROZEN_KV_MTP, DFLASH, DSPARK and "
            f"UNO workers only, not --speculative-algorithm {algo}."
        )
    since = SINCE.get(str(algo).upper())
    if since is not None and not _sglang_from(since, None):
        # before, its worker is a v1 worker of its own (FROZEN_KV_MTP's verify carries no hook,
        # DFLASH's commits the tokens itself)
        raise SpecProfileArgError(f"--speculative-profile times --speculative-algorithm {str(algo).upper()} from "
                                  f"SGLang {'.'.join(map(str, since))} on; profile without it here.")
    if getattr(args, "speculative_adaptive", False) and not hasattr(args, ADAPTIVE_FIELD):
        # upstream switches the step count batch by batch: without each cycle's step count a
        # bucket would mix them, and the advisor would read the mix as one setting
        raise SpecProfileArgError(
            "--speculative-profile times --speculative-adaptive on SGLang 0.5.15 to 0.5.18 only (its step count changes from "
            "batch to batch): profile without it here, and `sglang-specprof report --adaptive-config` writes its "
            "config."
        )
    path = args.speculative_profile_output
    if path:
        if os.path.isdir(path):
            raise SpecProfileArgError(f"--speculative-profile-output {path} is a folder; give a file path.")
        tp = getattr(args, "tp_size", 1)
        if isinstance(tp, int) and tp > 1:  # each rank writes its own file beside PATH, PATH itself none
            for rank in range(tp):
                _check_file(rank_path(path, rank), f"--speculative-profile-output {path}: rank {rank}'s file ")
        else:
            _check_file(path, "--speculative-profile-output ")


MULTI_LAYER_FROM = (0, 5, 16)  # the multi-layer worker verifies through run_eagle_verify (multilayer.py)
FROZEN_KV_FROM = (0, 5, 14)  # FROZEN_KV_MTP's v2 worker, whose verify is EAGLE v2's (frozen_kv.py)
DFLASH_FROM = (0, 5, 14)  # DFLASH's v2 worker (block_draft.py)
SINCE = {"FROZEN_KV_MTP": FROZEN_KV_FROM, "DFLASH": DFLASH_FROM}  # algorithms timed from a release on


def _sglang_from(bound: tuple, version: str | None) -> bool:
    """Whether SGLang `version` (None: the installed one) is `bound` or later."""
    if version is None:
        try:
            from sglang.version import __version__ as version
        except Exception:
            return False
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(version))
    return bool(m) and tuple(map(int, m.groups())) >= bound


def multi_layer_timed(version: str | None = None) -> bool:
    """Whether this SGLang's multi-layer EAGLE worker can be timed (MULTI_LAYER_FROM on)."""
    return _sglang_from(MULTI_LAYER_FROM, version)


def frozen_kv_timed(version: str | None = None) -> bool:
    """Whether this SGLang's FROZEN_KV_MTP worker can be timed (FROZEN_KV_FROM on)."""
    return _sglang_from(FROZEN_KV_FROM, version)


def dflash_timed(version: str | None = None) -> bool:
    """Whether this SGLang's DFLASH worker can be timed (DFLASH_FROM on)."""
    return _sglang_from(DFLASH_FROM, version)


def multi_layer_eagle(args) -> bool:
    """Whether the server will run multi-layer EAGLE: the flag, or SGLang turning it on for the
    model (MiMoV2, Step3p5 with EAGLE). From 0.5.15 a model's settings are declared while the
    arguments resolve and land on the fields only after this check runs, so the declarations
    are read too, the last one winning as when SGLang applies them."""
    value = getattr(args, "enable_multi_layer_eagle", False)
    try:
        for _source, declared in getattr(args, "_resolved_overrides", None) or ():
            if isinstance(declared, dict) and "enable_multi_layer_eagle" in declared:
                value = declared["enable_multi_layer_eagle"]
    except (TypeError, ValueError):  # not the (source, fields) pairs of the releases read
        pass
    return bool(value)


def _check_values(args) -> None:
    """The numbers and the path in range, with --speculative-profile or without it."""
    interval = getattr(args, "speculative_profile_interval", INTERVAL)
    if not _int(interval) or not 1 <= interval <= MAX_INTERVAL:
        raise SpecProfileArgError(f"--speculative-profile-interval must be 1 or more (at most {MAX_INTERVAL} decode "
                                  f"cycles a window), not {interval}.")
    kernels = getattr(args, "speculative_profile_kernels", 0) or 0
    if not _int(kernels) or kernels < 0:
        raise SpecProfileArgError(f"--speculative-profile-kernels must be 0 (off) or more, not {kernels}.")
    every = getattr(args, "speculative_profile_phases_every", 1)
    if not _int(every) or every < 1:
        raise SpecProfileArgError(f"--speculative-profile-phases-every must be 1 or more, not {every}.")
    path = getattr(args, "speculative_profile_output", None)
    if path is not None and not str(path).strip():
        raise SpecProfileArgError("--speculative-profile-output needs a file path; an empty one writes nothing.")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_file(path: str, what: str) -> None:
    """`path` can be appended to: its folder exists, and it is a regular file or nothing yet
    (checked without opening anything else: a FIFO would block). `what` begins each message."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise SpecProfileArgError(f"{what}{path} is a folder; give a file path.")
    if not os.path.isdir(folder):
        raise SpecProfileArgError(f"{what}{path}: the folder {folder} does not exist.")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        # a FIFO or a device would block the server or take its writes away: refuse it
        raise SpecProfileArgError(f"{what}{path} is not a regular file; give a file path.")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
        if not existed:  # only a check: the server makes it when it starts
            os.remove(path)
    except OSError as e:
        raise SpecProfileArgError(f"{what}{path} is not writable: {e.strerror}.") from None


def from_cli_args(parser: argparse.ArgumentParser, server_args_cls, raw_args):
    """ServerArgs.from_cli_args, with a profiler option error shown as a usage error.

    Up to 0.5.16 constructing ServerArgs runs the check (the patch calls `validate` where
    upstream handles speculative decoding); from 0.5.23 construction only records the
    options and resolution comes later, so the options are checked here as well, while
    the command line can still be refused with a usage error."""
    try:
        if getattr(raw_args, ADAPTIVE_FIELD, None) is not None and not hasattr(server_args_cls, ADAPTIVE_FIELD):
            raise SpecProfileArgError("--speculative-adaptive-policy needs the adaptive speculation hooks of SGLang 0.5.15 to 0.5.18, "
                                      "which this release's series does not have.")
        args = server_args_cls.from_cli_args(raw_args)
        validate(args)
        return args
    except SpecProfileArgError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
