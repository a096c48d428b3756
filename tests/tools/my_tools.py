"""Tools as a TRL user writes them (loaded by path in the tests)."""


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def undocumented(a: int) -> int:
    return a


def unhinted(a):
    """Returns a.

    Args:
        a: anything.
    """
    return a


async def fetch(url: str) -> str:
    """
    Fetches a page.

    Args:
        url: The address.
    """
    return url


class Counter:
    """A TRL environment_factory class (its public methods are tools)."""

    def reset(self, target: int = 3, **kwargs) -> None:
        self.counter, self.target = 0, int(target)

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
