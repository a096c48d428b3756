"""``TryAgain``, the text environment of the embedded model's agent experiment: loaded as the config names it, it
reads the last number of each reply against the row's answer."""

from qerl.tools.environment import environment_step, load_environment


def test_a_wrong_answer_is_told_to_try_again_and_a_right_one_ends_the_episode():
    factory = load_environment("qerl.tools.try_again:TryAgain")
    env, tools = factory.slot(0)
    assert tools == [] and environment_step(env) is not None  # plain-text replies, no tool methods
    env.reset(question="What is 3 + 5?", answer="8", source="arithmetic")
    assert env.step("3 + 5 = \\boxed{9}") == "That is not right. Try again."
    assert env.step("Sorry: 3 + 5 = 8, not 9.") == "That is not right. Try again."  # the last number counts
    assert env.step("It is 1,000 - 992 = \\boxed{8}.") is None
    env.reset(answer="12")  # a new episode forgets the last one's answer
    assert env.step("no number at all") == "That is not right. Try again." and env.step("12") is None
