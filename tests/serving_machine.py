"""Python code that, run first in a fresh process, makes it a serving machine: the compiler's
packages (deepinfer.codegen, deepinfer.passes) and the kernel languages (tilelang, triton) cannot
be imported there, as on a machine that has only the plan, torch and the CUDA driver."""

NO_COMPILER = """
import importlib.abc, sys
# None in sys.modules is how Python marks a module as absent: importing it fails, and
# importlib.util.find_spec answers None, as where it is not installed (torch's CUDA start-up
# probes for triton that way)
for name in ('deepinfer.codegen', 'deepinfer.passes', 'tilelang', 'triton'):
    sys.modules[name] = None
class NoCompiler(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('tilelang', 'triton') or name.split('.')[:2] in (['deepinfer', 'codegen'],
                                                                                   ['deepinfer', 'passes']):
            raise ImportError(f'{name} is not installed on this serving machine')
sys.meta_path.insert(0, NoCompiler())
try:
    import deepinfer.codegen
    raise SystemExit('the block did not hold')
except ImportError:
    pass
"""


def generate_script(plan, weights, prompts, max_tokens: int, **llm_kw) -> str:
    """A script that generates greedily from `plan` under NO_COMPILER and prints the tokens and the
    compiler modules it loaded (none, if the contract holds)."""
    kw = ", ".join(f"{k}={v!r}" for k, v in llm_kw.items())
    return NO_COMPILER + f"""
from deepinfer import LLM, SamplingParams
llm = LLM(plan={str(plan)!r}, weights={str(weights)!r}, {kw})
outs = llm.generate(prompt_token_ids={prompts!r},
                    sampling_params=SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True),
                    use_tqdm=False)
print('TOKENS', [o.token_ids for o in outs])
print('MODULES', sorted(m for m, mod in sys.modules.items()
                       if mod is not None and m.startswith(('deepinfer.codegen', 'deepinfer.passes'))))
"""


def parse_output(stdout: str) -> dict:
    return dict(ln.split(" ", 1) for ln in stdout.splitlines() if ln.startswith(("TOKENS", "MODULES")))
