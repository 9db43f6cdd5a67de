"""When a peer has surely posted a receive, so that a send to it can be awaited at once.

A gloo send is known complete only by waiting on it, once (a second wait blocks for a
next send), and a wait on a send whose receive is not posted yet blocks until the peer
posts it: possibly after the peer waits for something this rank has yet to send. So a
sent message's packed copy used to be held until its gradient came back. But every rank
posts its receives in a known order (:class:`~xgrad.torch_backend.pipeline_comm.StepWire`:
before its action ``k``, unless ``k`` is a send, every receive of its actions before
``k + window``, in schedule order, stopping at a gradient's receive whose forward has not
run yet), and a message is sent at a known action. So a message that arrives from a
peer proves which receives that peer had posted when it sent it, and the sends those
receives match can be awaited on the caller's thread without blocking on the peer's
compute (the peer's "ready" went out before the message that proved it: on the same
connection, or with two lanes on the other one, where it takes a message's latency at
most). No thread, no guess: the copies are freed at the first message back from that
peer that proves the receive.

Every rank must use the same ``post_ahead`` (the runtime's default): the knowledge is
computed with this rank's window.
"""

from __future__ import annotations

from xgrad.pipeline import Action, Kind, Schedule, expand

__all__ = ["PostedPlan", "check_release"]

#: what ``PipelineRuntime.release_sends`` may be.
RELEASES = ("posted", "gradient")


def check_release(release_sends: object, post_ahead: object) -> None:
    """Refuse a ``release_sends`` or ``post_ahead`` the runtime cannot honour, by name.

    Both are plain attributes a user may set between steps; a misspelt release mode must
    not quietly fall back to holding every sent copy, nor a window of 0 post nothing.
    """
    if release_sends not in RELEASES:
        raise ValueError(f"release_sends must be one of {RELEASES}, got {release_sends!r}")
    if isinstance(post_ahead, bool) or not isinstance(post_ahead, int) or post_ahead < 1:
        raise ValueError(f"post_ahead must be an integer >= 1, got {post_ahead!r}")


class PostedPlan:
    """Per peer, which of its receives are posted by each of its actions (computed once
    per schedule, rank's window).

    Attributes:
        frontier: per schedule rank, per index ``k`` of its actions, how many of its
            receives (in its posting order) are posted before action ``k`` runs.
        position: per receive action (of any rank), its place in its rank's posting order.
        sent_at: per send action (of any rank), its index in its rank's actions.
    """

    def __init__(self, schedule: Schedule, window: int) -> None:
        self.window = window
        self.frontier: dict[int, list[int]] = {}
        self.position: dict[Action, int] = {}
        self.sent_at: dict[Action, int] = {}
        for rank in range(schedule.num_ranks):
            actions = list(expand(schedule.actions[rank]))
            forward_at = {
                (a.stage, a.microbatch): i for i, a in enumerate(actions) if a.kind is Kind.FORWARD
            }
            recvs = [(i, a) for i, a in enumerate(actions) if a.kind in (Kind.RECV_F, Kind.RECV_B)]
            for n, (_, a) in enumerate(recvs):
                self.position[a] = n
            for i, a in enumerate(actions):
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    self.sent_at[a] = i
            posted, frontier = 0, []
            for k in range(len(actions)):
                # A send goes out before the receives due at it are posted (the peer waits
                # on the send): they are posted before the next action.
                is_send = actions[k].kind in (Kind.SEND_F, Kind.SEND_B)
                while not is_send and posted < len(recvs) and recvs[posted][0] < k + window:
                    a = recvs[posted][1]
                    # A gradient's receive waits for its forward (its shapes come from it).
                    if a.kind is Kind.RECV_B and forward_at.get((a.stage, a.microbatch), k) >= k:
                        break
                    posted += 1
                frontier.append(posted)
            self.frontier[rank] = frontier

    def proven(self, peer: int, sent: Action) -> int:
        """How many of ``peer``'s receives were posted when it sent ``sent``."""
        index = self.sent_at.get(sent)
        return 0 if index is None else self.frontier[peer][index]
