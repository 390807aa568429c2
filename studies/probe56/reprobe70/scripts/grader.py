import random, time, threading, json, sys
from emapg.rewards.math import math_reward
from emapg.rewards.math_reference import reference_math_reward
from emapg.tasks.math import MathTask
random.seed(1)
n = "".join(random.choice("123456789") for _ in range(1)) + "".join(random.choice("0123456789") for _ in range(4499))
res = {}
def t(name, fn):
    s = time.time()
    try: v = fn()
    except Exception as e: v = f"EXC {type(e).__name__}: {e}"[:200]
    res[name] = (v, round(time.time() - s, 2)); print(name, res[name], flush=True)
t("G1 plain boxed", lambda: math_reward(f"The answer is \\boxed{{{n}}}.", n))
t("G2 boxed with $", lambda: math_reward(f"\\boxed{{${n}$}}", n))
t("G3 negative", lambda: math_reward(f"\\boxed{{-{n}}}", "-" + n))
grp = ",".join([n[:len(n)%3]] * (len(n)%3>0) + [n[i:i+3] for i in range(len(n)%3, len(n), 3)])
t("G4 gold with thousands commas, boxed plain", lambda: math_reward(f"\\boxed{{{n}}}", grp))
t("G5 boxed leading zero", lambda: math_reward(f"\\boxed{{00{n}}}", n))
t("G6 wrong last digit (expect 0)", lambda: math_reward(f"\\boxed{{{n[:-1]}{(int(n[-1])+1)%10}}}", n))
r = []
th = threading.Thread(target=lambda: r.append(math_reward(f"\\boxed{{{n}}}", n))); s=time.time(); th.start(); th.join(60)
res["G7 thread"] = (r, round(time.time()-s,2)); print("G7 thread", res["G7 thread"])
t("G8 decimal 4500 digits", lambda: math_reward(f"\\boxed{{{n[:2000]}.{n[2000:]}}}", f"{n[:2000]}.{n[2000:]}"))
t("G9 unboxed final number (no box)", lambda: math_reward(f"So the answer is {n}", n))
t("G10 reference grader", lambda: reference_math_reward(f"</think> \\boxed{{{n}}}", [n]))
t("G11 boxed with trailing .0 gold float", lambda: math_reward(f"\\boxed{{{n}}}", n + ".0"))
t("G12 boxed spaces", lambda: math_reward(f"\\boxed{{ {n} }}", n))
json.dump(res, open("/tmp/reprobe/out/grader.json", "w"), default=str)
