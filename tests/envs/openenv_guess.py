"""An OpenEnv environment for the tests: guess a number in 1..10 (the target is seed + 3), told higher or
lower; reward 1 when right."""

from openenv.core import Action, Environment, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str = ""


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.target, self._state = 5, State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target, self._state = (seed or 0) + 3, State(step_count=0)
        return GuessObservation(message="Guess a number from 1 to 10.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(message="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(message=hint, done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
