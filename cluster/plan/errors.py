"""The planner's user errors, apart from its modules (which import Ray through the simulator):
``tandem plan`` must read a cluster's state through Ray before anything imports Ray."""


class PlanError(ValueError):
    """Something a user of ``tandem plan`` can fix; the message names the flag or the file."""


class ProfileError(PlanError):
    """A profile that cannot be read or used; the message names the file or the role."""


class RooflineError(PlanError):
    """An unknown hardware or model name; the message names the flag and the known ones."""
