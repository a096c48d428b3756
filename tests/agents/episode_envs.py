"""An environment as a TRL user writes one (loaded by path in the fit test): a tool method, a text ``step`` and its
own reward."""


class Echo:
    """Replies to every plain message once, then ends; pays for the replies it saw and for each echo call."""

    def reset(self, answer: str = "", **row) -> None:
        self.replies, self.echoes = 0, 0

    def step(self, message: str) -> str | None:
        self.replies += 1
        return None if self.replies >= 2 else "Go on."

    def get_reward(self) -> float:
        return 0.5 * self.replies + self.echoes

    def echo(self, text: str) -> str:
        """
        Repeat a text.

        Args:
            text: What to repeat.

        Returns:
            The same text.
        """
        self.echoes += 1
        return text


class RowTurns:
    """Answers (the row's answer mod 3) plain replies with "Go on.", then ends: an episode's length depends on its
    dataset row alone, so the episodes of a batch differ from one rank's share of it."""

    def reset(self, answer: str = "0", **row) -> None:
        self.left = int(answer) % 3

    def step(self, message: str) -> str | None:
        if self.left == 0:
            return None
        self.left -= 1
        return "Go on."
