"""Creates a container on Azurite (SharedKey auth, the emulator's well-known account): the one
request object_store cannot make. Usage: azurite_create_container.py PORT CONTAINER"""
import base64, hashlib, hmac, sys, urllib.request
from email.utils import formatdate

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
port, container = sys.argv[1], sys.argv[2]
date = formatdate(usegmt=True)
version = "2021-08-06"
to_sign = "PUT\n\n\n\n\n\n\n\n\n\n\n\n" + f"x-ms-date:{date}\nx-ms-version:{version}\n" \
    + f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container"
sig = base64.b64encode(hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
req = urllib.request.Request(
    f"http://127.0.0.1:{port}/{ACCOUNT}/{container}?restype=container", method="PUT",
    headers={"x-ms-date": date, "x-ms-version": version, "Authorization": f"SharedKey {ACCOUNT}:{sig}",
             "Content-Length": "0"})
with urllib.request.urlopen(req) as r:
    print(r.status)
