"""A loopback stand-in for the few Grafana HTTP API endpoints cluster.grafana uses (no Grafana
server can run here). It keeps Grafana's observable rules for them: bearer or basic auth (401),
404 for an unknown uid, 409 for a datasource name or folder uid taken, 412 for a dashboard uid
taken unless `overwrite`, 400 for a dashboard without a title or in an unknown folder, and a
version that grows by one on each save.
"""

from __future__ import annotations

import base64
import itertools
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse


def grafana_standin(token: str) -> tuple[FastAPI, dict[str, dict]]:
    """(app, state): state holds the datasources, folders and dashboards by uid."""
    app = FastAPI()
    state: dict[str, dict] = {"datasources": {}, "folders": {}, "dashboards": {}}
    ids = itertools.count(1)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        header = request.headers.get("authorization", "")
        basic = "Basic " + base64.b64encode(b"admin:admin").decode()
        if header not in (f"Bearer {token}", basic):
            return JSONResponse({"message": "Unauthorized"}, status_code=401)
        return await call_next(request)

    def found(kind: str, uid: str) -> dict:
        if uid not in state[kind]:
            raise HTTPException(404, "not found")
        return state[kind][uid]

    @app.get("/api/datasources/uid/{uid}")
    def get_datasource(uid: str) -> dict:
        return found("datasources", uid)

    @app.post("/api/datasources")
    def create_datasource(body: dict[str, Any]) -> dict:
        if any(d["name"] == body["name"] or d["uid"] == body.get("uid") for d in state["datasources"].values()):
            raise HTTPException(409, "data source with the same name or uid already exists")
        datasource = {**body, "id": next(ids), "version": 1}
        state["datasources"][datasource["uid"]] = datasource
        return {"datasource": datasource, "id": datasource["id"], "message": "Datasource added"}

    @app.put("/api/datasources/uid/{uid}")
    def update_datasource(uid: str, body: dict[str, Any]) -> dict:
        old = found("datasources", uid)
        if any(d["name"] == body["name"] and d["uid"] != uid for d in state["datasources"].values()):
            raise HTTPException(409, "data source with the same name already exists")
        state["datasources"][uid] = {**body, "uid": uid, "id": old["id"], "version": old["version"] + 1}
        return {"datasource": state["datasources"][uid], "message": "Datasource updated"}

    @app.get("/api/folders/{uid}")
    def get_folder(uid: str) -> dict:
        return found("folders", uid)

    @app.post("/api/folders")
    def create_folder(body: dict[str, Any]) -> dict:
        if body.get("uid") in state["folders"]:
            raise HTTPException(409, "a folder with the same uid already exists")
        folder = {"uid": body.get("uid") or f"f{next(ids)}", "title": body["title"], "id": next(ids)}
        state["folders"][folder["uid"]] = folder
        return folder

    @app.post("/api/dashboards/db")
    def save_dashboard(body: dict[str, Any]) -> dict:
        dashboard, folder = body.get("dashboard") or {}, body.get("folderUid")
        if not dashboard.get("title"):
            raise HTTPException(400, "Dashboard title cannot be empty")
        if folder is not None and folder not in state["folders"]:
            raise HTTPException(400, "folder not found")
        uid = dashboard.get("uid") or f"d{next(ids)}"
        old = state["dashboards"].get(uid)
        if old is not None and not body.get("overwrite"):
            raise HTTPException(412, "A dashboard with the same uid already exists")
        version = old["dashboard"]["version"] + 1 if old else 1
        state["dashboards"][uid] = {"dashboard": {**dashboard, "uid": uid, "version": version},
                                    "meta": {"folderUid": folder, "message": body.get("message")}}
        return {"status": "success", "uid": uid, "version": version, "url": f"/d/{uid}/{uid}"}

    @app.get("/api/dashboards/uid/{uid}")
    def get_dashboard(uid: str) -> dict:
        return found("dashboards", uid)

    return app, state
