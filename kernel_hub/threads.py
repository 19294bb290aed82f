"""placeholder during measurement"""
def apply_default_policy() -> None:
    pass
