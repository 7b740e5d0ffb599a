import os
import sys
import urllib.error
import urllib.request

url = sys.argv[1] + "/pods/" + os.environ["DENV_POD"]
agent = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    agent.open(url + "/ready", timeout=4).read()
except urllib.error.HTTPError as e:
    sys.exit("not warm: " + e.read().decode(errors="replace")[:300])
except OSError as e:
    sys.exit("warmth unknown, no agent answered: " + str(e))
