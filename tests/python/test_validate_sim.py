"""The turn-taking of benchmarks/scaling/validate_sim.py (``Turns``): the real and the simulated side of a paired
launch pass the same barriers, the side that goes first alternates step by step, and no timed step of one side
overlaps one of the other. Threads stand in for the 2P processes (a threading.Barrier for the process barrier)."""
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.scaling.validate_sim import Turns  # noqa: E402


def test_turns_alternate_and_never_overlap():
    per_side, steps = 2, 4
    barrier = threading.Barrier(2 * per_side)
    log, lock, running = [], threading.Lock(), {0: 0, 1: 0}
    overlaps = []

    def proc(side):
        t = Turns(barrier, side)
        for n in range(steps):
            t.begin()
            with lock:
                running[side] += 1
                if running[1 - side]:
                    overlaps.append((side, n))
                log.append((t.slot, side))
            time.sleep(0.01)
            with lock:
                running[side] -= 1
            t.end()
            time.sleep(0.005 * side)  # untimed work between steps: the turns still hold
        t.finish()

    threads = [threading.Thread(target=proc, args=(i // per_side,)) for i in range(2 * per_side)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert not any(th.is_alive() for th in threads), "a side is stuck at a barrier"
    assert not overlaps
    # Slot -> the side that ran in it: step n of side 0 in slot 2n for even n, 2n + 1 for odd n; side 1 the other.
    by_slot = {}
    for slot, side in log:
        by_slot.setdefault(slot, set()).add(side)
    assert by_slot == {0: {0}, 1: {1}, 2: {1}, 3: {0}, 4: {0}, 5: {1}, 6: {1}, 7: {0}}
    assert [s for s, _ in log] == sorted(s for s, _ in log)  # slots ran in order
