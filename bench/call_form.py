#!/usr/bin/env python3
"""What a hook call costs by where the method lives: on the profiler's class (a mixin, as
before the recorder was a part) or as the recorder's bound method set on the profiler
instance (`self.begin = recorder.begin`, as now). The patched files call `P.begin(...)`; the
interpreter specialises the first form better, by version. Interleaved, the best of
`--repeat` runs of 200,000 calls each, `--rounds` times.

  python bench/call_form.py [--rounds 3]
"""
import argparse
import sys
import timeit


class Recorder:
    def __init__(self):
        self.x = 0

    def begin(self, a):
        self.x += a


class Mixed(Recorder):  # the method on the class
    pass


class Composed:  # the recorder a part, its bound method on the instance
    def __init__(self):
        self.recorder = Recorder()
        self.begin = self.recorder.begin


class Hooks:  # the module the patched files call through (`hooks.P`)
    pass


def calls(hooks):
    def run():
        for _ in range(1000):
            hooks.P.begin(1)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    mixed, composed = Hooks(), Hooks()
    mixed.P, composed.P = Mixed(), Composed()
    for r in range(a.rounds):
        ns = {}
        for name, h in ((("class", mixed), ("instance", composed)) if r % 2 == 0 else
                        (("instance", composed), ("class", mixed))):
            ns[name] = min(timeit.repeat(calls(h), number=200, repeat=a.repeat)) / 200e3 * 1e9
        print(f"Python {sys.version.split()[0]}: on the class {ns['class']:.1f} ns a call, the recorder's bound "
              f"method on the instance {ns['instance']:.1f} ns (+{ns['instance'] - ns['class']:.1f} ns)", flush=True)


if __name__ == "__main__":
    main()
