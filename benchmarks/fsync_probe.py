import os, time, threading, tempfile
d = tempfile.mkdtemp(dir="/tmp")
def small(i):
    p = os.path.join(d, f"s{i}"); t = time.perf_counter()
    with open(p, "wb") as f: f.write(b"x" * 4096); f.flush(); os.fsync(f.fileno())
    return time.perf_counter() - t
print("small fsync alone ms:", [round(small(i)*1e3, 2) for i in range(5)])
big = os.urandom(105 << 20)
def bigw():
    with open(os.path.join(d, "big"), "wb") as f: f.write(big); f.flush(); os.fsync(f.fileno())
t = time.perf_counter(); bigw(); print("big 105MB write+fsync ms:", round((time.perf_counter()-t)*1e3, 1))
th = threading.Thread(target=bigw); th.start(); time.sleep(0.01)
print("small fsync during big ms:", [round(small(10+i)*1e3, 2) for i in range(3)]); th.join()
