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
# frozen_kv.py, block_draft.py, uno.py), their v1 workers too: every algorithm the releases ship,
# in every release that has it (multi-layer EAGLE's v1 worker aside: `multi_layer_v1`).
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
    if multi_layer_eagle(args):
        # its v2 worker is wrapped (multilayer.py); the v1 worker SGLang runs instead up to 0.5.12
        # where the overlap scheduler is off has no hook: served, the profile would stay empty
        fix = multi_layer_v1(args)
        if fix is not None:
            raise SpecProfileArgError(f"--speculative-profile times multi-layer EAGLE's v2 worker, which SGLang "
                                      f"{_installed()} runs here only {fix}; or profile without the flag.")
    if algo is not None and str(algo).upper() not in PROFILED_ALGORITHMS:
        raise SpecProfileArgError(
            f"--speculative-profile times the EAGLE, EAGLE3, STANDALONE, NGRAM, FROZEN_KV_MTP, DFLASH, DSPARK and "
            f"UNO workers only, not --speculative-algorithm {algo}."
        )
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


MULTI_LAYER_V2_ONLY = (0, 5, 13)  # from here SGLang runs multi-layer EAGLE's v2 worker whatever the settings
SPEC_V2_DEFAULT = (0, 5, 11)  # from here SGLANG_ENABLE_SPEC_V2 is on unless set off


def _sglang_from(bound: tuple, version: str | None) -> bool:
    """Whether SGLang `version` (None: the installed one) is `bound` or later."""
    if version is None:
        try:
            from sglang.version import __version__ as version
        except Exception:
            return False
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(version))
    return bool(m) and tuple(map(int, m.groups())) >= bound


def _installed() -> str:
    try:
        from sglang.version import __version__ as version
    except Exception:
        return "(unknown)"
    return str(version).split("+", 1)[0]


def _spec_v2_env() -> bool | None:
    """SGLANG_ENABLE_SPEC_V2 as upstream reads it (SGLang sets it itself for MiMoV2 and Step3p5
    models before this check runs), None where unset."""
    value = os.environ.get("SGLANG_ENABLE_SPEC_V2")
    if value is None:
        return None
    return value.strip().lower() in ("true", "1", "yes", "y")


def multi_layer_v1(args, version: str | None = None) -> str | None:
    """Where SGLang `version` (None: the installed one) would run multi-layer EAGLE's v1 worker
    (`MultiLayerEagleWorker`, which the profiler does not time) with these arguments, the words
    that say how to get the v2 worker (`MultiLayerEagleWorkerV2`, multilayer.py); else None.
    Upstream chooses the v1 worker where the overlap scheduler is off: up to 0.5.10 unless
    SGLANG_ENABLE_SPEC_V2 is on (off by default), in 0.5.11 and 0.5.12 where it is set off, with
    --disable-overlap-schedule or with topk > 1; from 0.5.13 never. (A topk that SGLang chooses
    for the model later, above 1, is seen when the worker starts: `hooks.idle` says so.)"""
    if _sglang_from(MULTI_LAYER_V2_ONLY, version):
        return None
    env = _spec_v2_env()
    if not _sglang_from(SPEC_V2_DEFAULT, version):
        return None if env else "with SGLANG_ENABLE_SPEC_V2=1 (SGLang sets it for MiMoV2 and Step3p5 models): set it"
    if env is False:
        return "with SGLANG_ENABLE_SPEC_V2 on: unset it"
    if getattr(args, "disable_overlap_schedule", False):
        return "with the overlap scheduler: drop --disable-overlap-schedule"
    topk = getattr(args, "speculative_eagle_topk", None)
    if isinstance(topk, int) and not isinstance(topk, bool) and topk > 1:
        return "at topk 1: set --speculative-eagle-topk 1"
    return None


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
