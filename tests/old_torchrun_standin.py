"""A torchrun from before torch 2.12, for the launch.sh tests: the installed torchrun with
``--shutdown-timeout`` taken out of its parser, as torch 2.8 (the apex image) has it. Such a
torchrun refuses a command line that carries the option ("unrecognized arguments") and gives
its workers a fixed 30 s after passing on a SIGTERM.

launch.sh runs it as its PYTHON, through a two-line wrapper the test writes:
``python old_torchrun_standin.py -m MODULE ARGS`` runs MODULE as ``__main__`` with that
torchrun; any other command line (launch.sh's ``-c`` GPU count) goes to Python as it is.
"""

import os
import runpy
import sys


def remove_shutdown_timeout() -> None:
    import torch.distributed.run as run

    original = run.get_args_parser

    def parser_of_an_older_torchrun():
        parser = original()
        for action in [a for a in parser._actions if "--shutdown-timeout" in a.option_strings]:
            parser._remove_action(action)
            for group in parser._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
            for flag in action.option_strings:
                parser._option_string_actions.pop(flag, None)
        parser.set_defaults(shutdown_timeout=None)  # the launcher's own default: 30 s
        return parser

    run.get_args_parser = parser_of_an_older_torchrun


if __name__ == "__main__":
    if sys.argv[1:2] != ["-m"]:
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    remove_shutdown_timeout()
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    sys.path.insert(0, os.getcwd())  # as `python -m` would: launch.sh runs from the repository
    runpy.run_module(module, run_name="__main__", alter_sys=True)
