import time, sys
from emapg.retrieval import open_retriever
from emapg.tags import format_information
from emapg.models.zoo import load_tokenizer
s = time.time()
r = open_retriever(index="/tmp/reprobe/w/idx_50mb")
print("loaded", round(time.time()-s, 2), flush=True)
s = time.time(); res = r.search(["word"], topk=3); print("search", round(time.time()-s,2), [ (p.id, len(p.text)) for p in res[0]], flush=True)
s = time.time(); info = format_information(res[0]); print("format", len(info), round(time.time()-s,2), flush=True)
import emapg.models.zoo as z
print([n for n in dir(z) if 'tiny' in n.lower() or 'folder' in n.lower()], flush=True)
tok = load_tokenizer(z.smollm2_folder())
s = time.time()
ids = tok(info, add_special_tokens=False).input_ids
print("tokenize 50MB info", len(ids), round(time.time()-s, 2), flush=True)
